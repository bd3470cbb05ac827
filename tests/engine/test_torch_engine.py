"""The PyTorch engine on the real SmolLM2-135M-Instruct engine directory (CPU, float32)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch

from tests.support import NEEDS_BF16_PACKING, AllowedTokens
from trtserver.engine.base import GenerationRequest, SamplingParams, SequenceOutput
from trtserver.engine.torch.engine import TorchEngine
from trtserver.errors import EngineError

_ids = iter(range(10**9))


async def collect(engine: TorchEngine, prompt: str | list[int], n: int = 1,
                  **params: object) -> tuple[dict[int, list[int]], dict[int, SequenceOutput], list[SequenceOutput]]:
    """Run one request; return tokens per index, the last delta per index, and every delta."""
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    request = GenerationRequest(f"t{next(_ids)}", ids, SamplingParams(**params), n=n)  # type: ignore[arg-type]
    tokens: dict[int, list[int]] = {}
    last: dict[int, SequenceOutput] = {}
    deltas = []
    async for delta in engine.generate(request):
        tokens.setdefault(delta.index, []).extend(delta.token_ids)
        last[delta.index] = delta
        deltas.append(delta)
    return tokens, last, deltas


async def greedy(engine: TorchEngine, prompt: str, max_tokens: int = 12) -> list[int]:
    """The prompt's greedy tokens; seeded, so no cached prefix (whose shorter prefill may round a near tie
    apart) makes them depend on what the engine ran before."""
    tokens, _, _ = await collect(engine, prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=0)
    return tokens[0]


async def wait_idle(engine: TorchEngine) -> None:
    for _ in range(200):
        if engine.stats().slots_used == 0 and engine.stats().waiting == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine still busy: {engine.stats()}")


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot",
           "The three primary colours are"]


async def test_info(engine: TorchEngine) -> None:
    info = engine.info
    assert info.model_name == "SmolLM2-135M-Instruct" and info.backend == "torch"
    assert info.vocab_size == 49152 and info.context_length == 384 and 2 in info.eos_token_ids
    caps = info.capabilities
    assert caps.prompt_logprobs and caps.beam_search and caps.guided_decoding and caps.abort and caps.priority


async def test_greedy_is_sensible_and_stable(engine: TorchEngine) -> None:
    first = await greedy(engine, "The capital of France is")
    assert "Paris" in engine.tokenizer.decode(first)
    assert await greedy(engine, "The capital of France is") == first


async def test_batched_greedy_equals_alone(engine: TorchEngine) -> None:
    alone = [await greedy(engine, p) for p in PROMPTS]
    together = await asyncio.gather(*(greedy(engine, p) for p in PROMPTS))
    assert list(together) == alone


async def test_seeded_sampling_repeats(engine: TorchEngine) -> None:
    params = dict(max_tokens=10, temperature=1.0, ignore_eos=True)
    a = (await collect(engine, "My favourite animal is", seed=7, **params))[0][0]
    # same seed, inside a busy batch this time
    busy = [collect(engine, p, seed=None, **params) for p in PROMPTS]
    results = await asyncio.gather(collect(engine, "My favourite animal is", seed=7, **params), *busy)
    assert results[0][0][0] == a
    others = {tuple((await collect(engine, "My favourite animal is", seed=s, **params))[0][0]) for s in (1, 2, 3)}
    assert len(others | {tuple(a)}) > 1


async def test_n_shares_one_prefill(engine: TorchEngine) -> None:
    await wait_idle(engine)
    prompt = engine.tokenizer.encode("Write a haiku about the sea:")
    assert len(prompt) <= 16  # one chunk: one prefill forward for the whole request
    before = engine.core.num_prefill_forwards
    tokens, last, _ = await collect(engine, prompt, n=3, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    assert engine.core.num_prefill_forwards - before == 1
    assert sorted(tokens) == [0, 1, 2] and all(len(t) == 8 for t in tokens.values())
    assert len({tuple(t) for t in tokens.values()}) > 1  # each sequence has its own generator
    assert all(d.finish_reason == "length" for d in last.values())
    again, _, _ = await collect(engine, prompt, n=3, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    assert again == tokens


def reference_prompt_logprobs(engine: TorchEngine, ids: list[int]) -> torch.Tensor:
    """log p(token i | tokens < i) from one unchunked forward over a private cache."""
    from trtserver.engine.torch.cache import KVCache
    from trtserver.engine.torch.model import ForwardContext

    model = engine.core.model
    a = model.args
    cache = KVCache(a.n_layers, 1, a.n_kv_heads, engine.max_model_len, a.head_dim, torch.float32, torch.device("cpu"))
    T = len(ids)
    ctx = ForwardContext(torch.arange(T).unsqueeze(0), torch.tensor([0]), 0, T, None, causal=True)
    with torch.inference_mode():
        logprobs = torch.log_softmax(model.logits(model(torch.tensor([ids]), ctx, cache)[0]), dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


async def test_prompt_logprobs_across_chunks(engine: TorchEngine) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 4  # > 2 chunks of 16 tokens
    ids = engine.tokenizer.encode(text)
    assert len(ids) > 32
    tokens, last, deltas = await collect(engine, ids, max_tokens=2, temperature=0.0, prompt_logprobs=3)
    first = deltas[0]
    assert first.index == 0
    assert first.prompt_token_logprobs is not None and first.prompt_logprobs is not None
    assert len(first.prompt_token_logprobs) == len(ids) == len(first.prompt_logprobs)
    assert first.prompt_token_logprobs[0] is None and first.prompt_logprobs[0] is None
    assert all(len(top) == 3 for top in first.prompt_logprobs[1:])  # type: ignore[arg-type]
    expected = reference_prompt_logprobs(engine, ids)
    got = torch.tensor(first.prompt_token_logprobs[1:])
    assert torch.allclose(got, expected, atol=1e-4)
    assert all(d.prompt_token_logprobs is None for d in deltas[1:])


async def test_max_tokens_zero_scores_the_prompt(engine: TorchEngine) -> None:
    ids = engine.tokenizer.encode("Paris is the capital of France.")
    tokens, last, deltas = await collect(engine, ids, max_tokens=0, prompt_logprobs=1, logprobs=1)
    assert len(deltas) == 1 and deltas[0].token_ids == [] and deltas[0].finish_reason == "length"
    assert deltas[0].num_prompt_tokens == len(ids)
    plp = deltas[0].prompt_token_logprobs
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    assert all(x is not None and x <= 0 for x in plp[1:])


async def test_generated_logprobs(engine: TorchEngine) -> None:
    _, _, deltas = await collect(engine, "The capital of France is", max_tokens=4, temperature=0.0, logprobs=2)
    lps = [x for d in deltas for x in (d.logprobs or [])]
    tops = [x for d in deltas for x in (d.top_logprobs or [])]
    toks = [t for d in deltas for t in d.token_ids]
    assert len(lps) == len(tops) == len(toks) == 4
    for tok, lp, top in zip(toks, lps, tops):  # greedy: the sampled token is the top-1
        assert top[0][0] == tok and abs(top[0][1] - lp) < 1e-5 and len(top) == 2


async def test_stop_token_ids(engine: TorchEngine) -> None:
    free = await greedy(engine, "The capital of France is", max_tokens=8)
    stop = free[3]
    k = free.index(stop)
    tokens, last, _ = await collect(engine, "The capital of France is", max_tokens=8, temperature=0.0, seed=0,
                                    stop_token_ids=(stop,))
    assert tokens[0] == free[:k + 1]  # the stop token is included
    assert last[0].finish_reason == "stop" and last[0].stop_token_id == stop


async def test_eos_and_min_tokens(engine: TorchEngine) -> None:
    eos = engine.info.eos_token_ids[0]
    bias = ((eos, 100.0),)
    tokens, last, _ = await collect(engine, "Hello", max_tokens=10, temperature=0.0, logit_bias=bias)
    assert tokens[0] == [eos] and last[0].finish_reason == "stop" and last[0].stop_token_id is None
    tokens, last, _ = await collect(engine, "Hello", max_tokens=10, temperature=0.0, logit_bias=bias, min_tokens=4)
    assert len(tokens[0]) == 5 and eos not in tokens[0][:4] and tokens[0][4] == eos
    tokens, last, _ = await collect(engine, "Hello", max_tokens=3, temperature=0.0, logit_bias=bias, ignore_eos=True)
    assert tokens[0] == [eos] * 3 and last[0].finish_reason == "length"


class ForceToken:
    def __init__(self, token: int, seen: list[list[int]]) -> None:
        self.token, self.seen = token, seen

    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> None:
        self.seen.append(list(output_token_ids))
        keep = logits[self.token].item()
        logits.fill_(float("-inf"))
        logits[self.token] = keep


async def test_logits_processors_run_per_sequence(engine: TorchEngine) -> None:
    seen: list[list[int]] = []
    made: list[ForceToken] = []

    def factory() -> ForceToken:
        made.append(ForceToken(42, seen))
        return made[-1]

    ids = engine.tokenizer.encode("Hello there")
    request = GenerationRequest("procs", ids, SamplingParams(max_tokens=3, temperature=1.0), n=2,
                                logits_processors=(factory,))
    out = [d async for d in engine.generate(request)]
    assert len(made) == 2  # one per sequence
    assert all(t == 42 for d in out for t in d.token_ids)
    assert sorted(map(len, seen)) == [0, 0, 1, 1, 2, 2]



async def test_token_constraint_is_honoured(engine: TorchEngine) -> None:
    allowed = tuple(engine.tokenizer.encode(" yes no maybe"))
    guide = AllowedTokens(allowed, steps=4)
    ids = engine.tokenizer.encode("Answer:")
    request = GenerationRequest("guided", ids, SamplingParams(max_tokens=10, temperature=1.0, seed=1), guided=guide)
    out = [d async for d in engine.generate(request)]
    toks = [t for d in out for t in d.token_ids]
    assert len(toks) == 4 and set(toks) <= set(allowed) and out[-1].finish_reason == "stop"


async def test_abort_frees_the_slot(engine: TorchEngine) -> None:
    await wait_idle(engine)
    ids = engine.tokenizer.encode("Count to one hundred:")
    gen = engine.generate(GenerationRequest("abort-me", ids, SamplingParams(max_tokens=300, ignore_eos=True)))
    await gen.__anext__()
    assert engine.stats().slots_used == 1 and engine.stats().running == 1
    await gen.aclose()
    await wait_idle(engine)
    assert engine.stats().slots_used == 0

    # abort one sequence of two: it ends with "abort", the other runs to its end
    request = GenerationRequest("abort-one", ids, SamplingParams(max_tokens=12, ignore_eos=True), n=2)
    reasons = {}
    async for delta in engine.generate(request):
        if delta.index == 1 and not reasons:
            engine.abort("abort-one", 1)
            reasons["sent"] = "yes"
        if delta.finish_reason:
            reasons[delta.index] = delta.finish_reason
    assert reasons[1] == "abort" and reasons[0] == "length"
    await wait_idle(engine)


async def test_cancelled_consumer_aborts(engine: TorchEngine) -> None:
    await wait_idle(engine)
    ids = engine.tokenizer.encode("Tell me a long story:")

    async def consume() -> None:
        async for _ in engine.generate(GenerationRequest("cancel-me", ids, SamplingParams(max_tokens=300))):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_idle(engine)


async def test_worker_errors_fail_only_that_request(engine: TorchEngine) -> None:
    def broken() -> object:
        def proc(output_ids: Sequence[int], logits: torch.Tensor) -> None:
            raise RuntimeError("boom")
        return proc

    ids = engine.tokenizer.encode("Hello")
    with pytest.raises(EngineError, match="boom"):
        async for _ in engine.generate(GenerationRequest("broken", ids, SamplingParams(max_tokens=4),
                                                         logits_processors=(broken,))):
            pass
    await wait_idle(engine)
    assert "Paris" in engine.tokenizer.decode(await greedy(engine, "The capital of France is"))


async def test_beam_search(engine: TorchEngine) -> None:
    ids = engine.tokenizer.encode("The capital of France is")
    request = GenerationRequest("beam", ids, SamplingParams(max_tokens=6, temperature=0.0, use_beam_search=True,
                                                            length_penalty=1.0, early_stopping=False), n=3)
    out = [d async for d in engine.generate(request)]
    assert sorted(d.index for d in out) == [0, 1, 2]
    assert all(d.finish_reason in ("stop", "length") and d.token_ids for d in out)
    scores = [d.cumulative_logprob for d in sorted(out, key=lambda d: d.index)]
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(d.token_ids) for d in out}) == 3
    best = min(out, key=lambda d: d.index)
    assert "Paris" in engine.tokenizer.decode(best.token_ids)
    # (checked by hand against transformers' generate(num_beams=3): same beams, same scores)
    await wait_idle(engine)


async def test_refusals(engine: TorchEngine) -> None:
    from trtserver.errors import ContextLengthExceeded, InvalidRequest

    with pytest.raises(ContextLengthExceeded):
        engine.generate(GenerationRequest("long", [1] * 400, SamplingParams()))
    with pytest.raises(InvalidRequest):
        engine.generate(GenerationRequest("wide", [1, 2], SamplingParams(), n=9))


def test_thread_counts_follow_the_options(smol_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """(small forwards, large forwards) on an 8-core CPU: with the model on the server's thread, a core
    left to the event loop where the GEMMs are too small to share; in its own process, every core."""
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 8)

    def threads(**options: object) -> tuple[int, int] | None:
        # float32: batch_invariant refuses bfloat16 on a CPU whose bfloat16 GEMMs are row-variant (the counts are alike)
        engine = TorchEngine.from_dir(smol_dir, device="cpu", dtype="float32", **options)  # type: ignore[arg-type]
        if engine.device is None:  # engine_process: settled where the model loads, in the engine process
            engine._resolve()
        return engine._threads()

    assert threads() == (7, 8)
    assert threads(threads=3) == (3, 3)  # --threads alone pins both, as before --batch-threads existed
    assert threads(batch_threads=2) == (7, 2)
    assert threads(threads=3, batch_threads=5) == (3, 5)
    assert threads(batch_invariant=True) == (7, 7)  # one count: the GEMMs' blocking may follow it
    assert threads(engine_process=True) == (8, 8)
    assert threads(engine_process=True, threads=3) == (3, 3)
    assert threads(engine_process=True, batch_threads=2) == (8, 2)


def test_core_switches_threads_by_rows_in_the_forward(smol_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from trtserver.engine.torch.model_runner import SMALL_BATCH

    # no prefix cache: the shared first prompt token would shrink the second prefill to small rows
    eng = TorchEngine.from_dir(smol_dir, device="cpu", dtype="float32", max_batch_size=8, max_model_len=64,
                               threads=1, batch_threads=2, prefix_cache=False)
    eng.load()
    core = eng.core
    assert core.model_runner.threads == (1, 2)
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)  # record only: the test stays on one core

    def add(name: str, prompt_len: int) -> None:
        core.add(GenerationRequest(name, list(range(10, 10 + prompt_len)),
                                   SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))

    add("long", 2 * SMALL_BATCH)
    core.step()  # prefill of 8 prompt tokens: large
    core.step()  # decode, 1 row: small
    core.step()  # again: no call, the count is already right
    for i in range(SMALL_BATCH):
        add(f"short{i}", 2)
    core.step()  # prefill of 4 x 2 tokens, then a decode of 1 row
    core.step()  # decode of 5 rows: large
    assert calls == [2, 1, 2, 1, 2]
    core.model_runner.small_batch = 8  # an int4-kernel server of 8 slots: every decode batch small
    core.model_runner.use_threads(6)
    core.model_runner.use_threads(9)
    assert calls == [2, 1, 2, 1, 2, 1, 2]


@NEEDS_BF16_PACKING
async def test_batch_invariant_beyond_the_small_batch(smol_dir) -> None:  # type: ignore[no-untyped-def]
    """More rows than SMALL_BATCH: with batch_invariant, each prompt's greedy tokens are the same alone
    and in the crowd, although alone it is a batch of one. In bfloat16 where this CPU's bfloat16 GEMMs keep a
    row's bits wherever it sits in a batch; elsewhere bfloat16 asked for is refused, and auto takes float32."""
    from trtserver.engine.torch.cpu.weights import bf16_rows_invariant
    from trtserver.engine.torch.model_runner import SMALL_BATCH

    options = dict(device="cpu", max_batch_size=8, max_model_len=128, threads=1, batch_invariant=True)
    dtype = "bfloat16"
    if not bf16_rows_invariant():
        with pytest.raises(ValueError, match="round a row by its place"):
            refused = TorchEngine.from_dir(smol_dir, dtype="bfloat16", **options)
            await refused.start()
        dtype = "auto"
    eng = TorchEngine.from_dir(smol_dir, dtype=dtype, **options)
    await eng.start()
    try:
        assert eng.dtype == (torch.bfloat16 if dtype == "bfloat16" else torch.float32)
        prompts = PROMPTS + ["My favourite animal is", "Water boils at"]
        assert len(prompts) > SMALL_BATCH
        alone = [await greedy(eng, p, max_tokens=8) for p in prompts]
        together = await asyncio.gather(*(greedy(eng, p, max_tokens=8) for p in prompts))
        assert list(together) == alone
    finally:
        await eng.shutdown()
