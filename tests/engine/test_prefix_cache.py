"""The prefix cache on the real model: what it serves is what recomputing gives, in every mode.

``engine`` (conftest) caches prefixes; ``uncached`` is the same engine with ``prefix_cache=False``.
Prompts span several of the 16-token prefill chunks, so a cached prefix ends mid-chunk."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import AllowedTokens
from trtserver.engine.base import GenerationRequest, SamplingParams, SequenceOutput
from trtserver.engine.torch.engine import TorchEngine

_ids = count()

DOC = ("The lighthouse stood on a rock at the mouth of the bay. Every night for forty years the keeper climbed "
       "its ninety steps, trimmed the wick and polished the great lens, and every morning he wrote the weather "
       "in a leather book. ")
QUESTIONS = ["Question: how many steps did the keeper climb? Answer:",
             "Question: what did he write in the book? Answer:",
             "Question: where was the lighthouse? Answer:"]


@pytest.fixture(scope="module")
def uncached(smol_dir: Path) -> Iterator[TorchEngine]:
    eng = TorchEngine.from_dir(smol_dir, dtype="float32", device="cpu", max_batch_size=8, max_model_len=384,
                               prefill_chunk_size=16, seed=0, threads=1, prefix_cache=False)
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.shutdown())


class Run:
    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[float]] = {}
        self.cumulative: dict[int, float] = {}
        self.prompt_logprobs: list[float | None] | None = None
        self.cached = 0


async def run(engine: TorchEngine, ids: list[int], n: int = 1, constraint: Any = None, **params: Any) -> Run:
    params = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True, "logprobs": 2, **params}
    request = GenerationRequest(f"pc{next(_ids)}", ids, SamplingParams(**params), n=n, guided=constraint)
    out = Run()
    delta: SequenceOutput
    async for delta in engine.generate(request):
        out.tokens.setdefault(delta.index, []).extend(delta.token_ids)
        out.logprobs.setdefault(delta.index, []).extend(delta.logprobs or [])
        out.cumulative[delta.index] = delta.cumulative_logprob
        out.cached = delta.num_cached_tokens
        if delta.prompt_token_logprobs is not None:
            out.prompt_logprobs = delta.prompt_token_logprobs
    return out


def same(cached: Run, fresh: Run) -> None:
    assert cached.tokens == fresh.tokens
    for index, lps in fresh.logprobs.items():
        torch.testing.assert_close(torch.tensor(cached.logprobs[index]), torch.tensor(lps), atol=1e-4, rtol=1e-4)


def encode(engine: TorchEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


async def test_questions_on_one_document_reuse_it(engine: TorchEngine, uncached: TorchEngine) -> None:
    doc = encode(engine, DOC)
    assert len(doc) > 40
    before = engine.stats().prefix_cache_hit_tokens
    served = []
    for question in QUESTIONS:
        ids = encode(engine, DOC + question)
        assert ids[:len(doc) - 1] == doc[:-1]
        cached, fresh = await run(engine, ids), await run(uncached, ids)
        same(cached, fresh)
        assert fresh.cached == 0
        served.append(cached.cached)
    assert all(n >= len(doc) - 1 for n in served[1:]), served
    await asyncio.sleep(0.05)  # the stats ride on the engine's next step message
    assert engine.stats().prefix_cache_hit_tokens - before >= sum(served)
    assert engine.info.capabilities.prefix_caching and not uncached.info.capabilities.prefix_caching


async def test_equal_prefix_and_diverging_prompts(engine: TorchEngine, uncached: TorchEngine) -> None:
    base = encode(engine, DOC + "In the end, the keeper")
    first = await run(engine, base)
    equal = await run(engine, base)
    assert equal.cached == len(base) - 1  # all but the last token, whose logits start decoding
    same(equal, first)
    shorter = base[:len(base) - 7]
    prefix = await run(engine, shorter)
    assert prefix.cached == len(shorter) - 1
    same(prefix, await run(uncached, shorter))
    other = [base[1]] + base[1:]  # differs at token 0: nothing shared
    diverged = await run(engine, other)
    assert diverged.cached == 0
    same(diverged, await run(uncached, other))


async def test_next_turn_extends_the_finished_sequence(engine: TorchEngine, uncached: TorchEngine) -> None:
    turn = encode(engine, DOC + "Tell me about the keeper.")
    answer = await run(engine, turn, max_tokens=12)
    follow = turn + answer.tokens[0] + encode(engine, " And what about the lens?")
    # the first turn's generated tokens are cached too, all but the last (its K/V were never written)
    nxt = await run(engine, follow)
    assert nxt.cached >= len(turn) + len(answer.tokens[0]) - 1
    same(nxt, await run(uncached, follow))


@pytest.mark.parametrize("mode", ["n", "seeded", "beam", "constraint", "stop"])
async def test_modes_agree_with_recomputing(engine: TorchEngine, uncached: TorchEngine, mode: str) -> None:
    ids = encode(engine, DOC + QUESTIONS[0] + f" ({mode})")
    params: dict[str, Any] = {}
    n, constraint = 1, None
    if mode == "n":
        n = 3
    elif mode == "seeded":
        n, params = 2, {"temperature": 0.9, "seed": 11}
    elif mode == "beam":
        n, params = 2, {"use_beam_search": True, "length_penalty": 1.0, "logprobs": None}
    elif mode == "constraint":
        allowed = (await run(uncached, ids)).tokens[0][:3] + [13, 28]
        constraint = AllowedTokens(allowed)
    else:
        params = {"stop_token_ids": [(await run(uncached, ids)).tokens[0][4]]}
    await run(engine, ids, n=n, constraint=constraint, **params)  # fills the cache
    cached = await run(engine, ids, n=n, constraint=constraint, **params)
    fresh = await run(uncached, ids, n=n, constraint=constraint, **params)
    # a seeded request recomputes its prompt, and so does beam search: a cached prefix's last-bit differences
    # (positions computed in another chunk shape) swapped two of its near-tied hypotheses
    assert cached.cached == (0 if mode in ("seeded", "beam") else len(ids) - 1)
    same(cached, fresh)
    if mode == "beam":
        for index, score in fresh.cumulative.items():
            assert cached.cumulative[index] == pytest.approx(score, abs=1e-4)


async def test_prompt_logprobs_are_recomputed(engine: TorchEngine, uncached: TorchEngine) -> None:
    ids = encode(engine, DOC + "Scored:")
    await run(engine, ids)
    scored = await run(engine, ids, prompt_logprobs=1)
    assert scored.cached == 0
    fresh = await run(uncached, ids, prompt_logprobs=1)
    assert scored.prompt_logprobs is not None and fresh.prompt_logprobs is not None
    torch.testing.assert_close(torch.tensor(scored.prompt_logprobs[1:]), torch.tensor(fresh.prompt_logprobs[1:]),
                               atol=1e-4, rtol=1e-4)
    same(scored, fresh)


async def test_a_running_requests_prompt_is_copied(engine: TorchEngine, uncached: TorchEngine) -> None:
    long_doc = DOC * 2
    first_ids = encode(engine, long_doc + QUESTIONS[1])
    later_ids = encode(engine, long_doc + QUESTIONS[2])
    sampling = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    first = engine.generate(GenerationRequest(f"pc{next(_ids)}", first_ids, sampling))
    try:
        await anext(first)  # its prompt is computed: it decodes, holding its slot
        later = await run(engine, later_ids)
        assert (await anext(first)).finish_reason is None, "the first request ended before the second came"
    finally:
        await first.aclose()  # type: ignore[attr-defined]
    assert later.cached >= len(encode(engine, long_doc)) - 1
    same(later, await run(uncached, later_ids))


async def test_a_seed_repeats_its_text_where_rounding_differs_between_chunk_shapes(smol_dir: Path) -> None:
    """int4 rounds activations to bfloat16, so a prefix computed in one chunk shape and its last token in
    another can round apart from a fresh prefill and move a sample at temperature 1: a seeded request
    takes no cached prefix, and repeats its text exactly; the same prompt unseeded still hits the cache."""
    eng = TorchEngine.from_dir(smol_dir, dtype="float32", quantize="int4", device="cpu", max_batch_size=4,
                               max_model_len=256, seed=0, threads=1)
    await eng.start()
    try:
        ids = encode(eng, "Once upon a time")
        for seed in (7, 8, 9):
            first, again = [await run(eng, ids, max_tokens=16, temperature=1.0, seed=seed, logprobs=None)
                            for _ in range(2)]
            assert again.cached == 0 and again.tokens == first.tokens, seed
        greedy = [await run(eng, ids, max_tokens=4) for _ in range(2)]
        assert greedy[1].cached == len(ids) - 1
    finally:
        await eng.shutdown()
