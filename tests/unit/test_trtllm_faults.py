"""The faults found by reading TensorRT-LLM's own source, each against the stand-in of the version it
bites on (the stand-ins reproduce that source; see tests/standins/README.md)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.standins import harness
from tests.unit.test_trtllm_engine import collect, make_engine, request

standin = harness.standin

PROMPT = [2, 3, 5, 9, 4]


def expected_prompt_logprobs(k: int) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """What a correct engine reports: row i-1 of the model's context logits scores prompt token i."""
    import standin_core
    import torch

    rows = torch.log_softmax(standin_core.context_logits(PROMPT, len(harness.VOCAB)), dim=-1)
    values: list[float | None] = [None]
    tops: list[list[tuple[int, float]] | None] = [None]
    for i in range(1, len(PROMPT)):
        values.append(float(rows[i - 1, PROMPT[i]]))
        top_v, top_i = rows[i - 1].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        tops.append([(int(t), float(v)) for t, v in zip(top_i, top_v, strict=True)])
    return values, tops


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize(("generation", "engine"), [("v1", True), ("v1", False)])
def test_prompt_logprobs_score_each_prompt_token_from_the_previous_position(
    standin: Any, tmp_path: Path, generation: str, engine: bool, k: int
) -> None:
    e = make_engine(standin, tmp_path, generation, engine=engine, build={"gather_context_logits": True})
    deltas = asyncio.run(collect(e, request(prompt=PROMPT, max_tokens=1, prompt_logprobs=k)))
    values, tops = expected_prompt_logprobs(k)
    got = deltas[0]
    assert got.prompt_token_logprobs == pytest.approx(values)
    assert got.prompt_logprobs is not None and got.prompt_logprobs[0] is None
    for have, want in zip(got.prompt_logprobs[1:], tops[1:], strict=True):
        assert have is not None and [t for t, _ in have] == [t for t, _ in want]
        assert [v for _, v in have] == pytest.approx([v for _, v in want])
