"""graphs.py's bucketing, which CUDA graphs replay, driven on the CPU: each (rows, length) bucket's step
runs eagerly where a captured graph would replay. Same tokens as the engine's own decode path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from trtserver.engine.base import GenerationRequest, SamplingParams
from trtserver.engine.torch.core import EngineCore
from trtserver.engine.torch.graphs import Bucket, DecodeGraphs, powers_of_two
from trtserver.engine.torch.model import Transformer, load_model
from trtserver.engine.torch.model_runner import ModelRunner


class EagerGraphs(DecodeGraphs):
    """``run`` computes the bucket's step instead of replaying its graph, and records the bucket."""

    def __init__(self, runner: ModelRunner, **kwargs: object) -> None:
        super().__init__(runner, **kwargs)  # type: ignore[arg-type]
        self.replayed: list[tuple[Bucket, list[int]]] = []

    def decode(self, seqs: list) -> Tensor:  # type: ignore[type-arg]
        self.replayed.append((self.bucket(seqs), sorted(s.slot for s in seqs)))
        return super().decode(seqs)

    def run(self, bucket: Bucket) -> Tensor:
        with torch.inference_mode():
            return self._step(bucket)


@pytest.fixture(scope="module")
def model(smol_dir: Path) -> Transformer:
    return load_model(smol_dir, torch.float32, torch.device("cpu"))


def generate(model: Transformer, graphs: dict[str, object] | None) -> tuple[dict, EagerGraphs | None]:  # type: ignore[type-arg]
    torch.set_num_threads(1)
    core = EngineCore(model, num_slots=4, max_len=300, chunk_size=64, eos_token_ids=[0],
                      device=torch.device("cpu"), seed=0)
    if graphs is not None:
        core.model_runner.graphs = EagerGraphs(core.model_runner, **graphs)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    core.add(GenerationRequest("alone", list(range(100, 140)), greedy))
    out: dict[tuple[str, int], list[tuple[int, float]]] = {}
    steps = 0
    while core.has_work:
        for delta in core.step():
            out.setdefault((delta.request_id, delta.index), []).extend(zip(delta.token_ids, delta.logprobs or []))
        steps += 1
        if steps == 4:  # two more sequences (n=2) join in slots 1 and 2, one with a 90-token prompt
            core.add(GenerationRequest("pair", list(range(200, 290)), greedy, n=2))
        if steps == 6:
            core.add(GenerationRequest("late", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, logprobs=0)))
    return out, core.model_runner.graphs


def assert_same(a: dict, b: dict) -> None:  # type: ignore[type-arg]
    assert a.keys() == b.keys() and all(len(v) == 12 for k, v in a.items() if k[0] != "late")
    for key in a:
        assert [t for t, _ in a[key]] == [t for t, _ in b[key]], key
        assert [lp for _, lp in a[key]] == pytest.approx([lp for _, lp in b[key]], abs=1e-4)


def test_buckets_hold_the_highest_slot_and_the_longest_sequence(model: Transformer) -> None:
    eager, _ = generate(model, None)
    bucketed, graphs = generate(model, {"min_length": 64})
    assert_same(eager, bucketed)
    assert isinstance(graphs, EagerGraphs)
    assert graphs.row_buckets == [1, 2, 4] and graphs.length_buckets == [64, 128, 256, 300]
    used = {bucket for bucket, _ in graphs.replayed}
    assert (1, 64) in used  # one stream reads only its own slot
    assert (4, 128) in used  # slots 0-2 busy, the pair's 90-token prompt past 64
    for (rows, _), slots in graphs.replayed:
        assert max(slots) < rows and (rows == 1 or max(slots) >= rows // 2)  # the smallest that holds them


def test_batch_invariant_graphs_run_every_slot(model: Transformer) -> None:
    eager, _ = generate(model, None)
    bucketed, graphs = generate(model, {"min_length": 256, "all_rows": True})
    assert_same(eager, bucketed)
    assert graphs is not None and {rows for (rows, _), _ in graphs.replayed} == {4}


def test_powers_of_two_end_at_the_limit() -> None:
    assert powers_of_two(1, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert powers_of_two(256, 1000) == [256, 512, 1000]
    assert powers_of_two(1, 1) == [1]
