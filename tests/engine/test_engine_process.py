"""The PyTorch engine in a process of its own (``engine_process``), against the same engine in this
process, and the wire between them (``transport/messages.py``)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.engine.test_torch_engine import PROMPTS, collect, greedy, wait_idle
from tests.support import AllowedTokens, BanToken
from trtserver.config import ServerConfig
from trtserver.engine.base import EngineStats, GenerationRequest, Priority, SamplingParams, SequenceOutput
from trtserver.engine.torch.engine import TorchEngine
from trtserver.engine.torch.transport import messages as ipc
from trtserver.errors import EngineError, InvalidRequest, NotFound


@pytest_asyncio.fixture(scope="module")
async def proc_engine(smol_dir: Path) -> AsyncIterator[TorchEngine]:
    # the options of the in-process ``engine`` fixture, so the two must agree token for token
    config = ServerConfig(engine_dir=str(smol_dir), engine="torch", dtype="float32", device="cpu", max_batch_size=8,
                          max_model_len=384, prefill_chunk_size=16, threads=1, engine_process=True)
    eng = TorchEngine(config, seed=0)
    await eng.start()
    yield eng
    await eng.shutdown()


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


async def test_same_tokens_and_logprobs_as_in_process(proc_engine: TorchEngine, engine: TorchEngine) -> None:
    assert proc_engine.core is None  # the model is not in this process
    for prompt in PROMPTS[:2]:
        assert await greedy(proc_engine, prompt) == await greedy(engine, prompt)
    theirs = await collect(proc_engine, PROMPTS[2], max_tokens=5, temperature=0.0, logprobs=3, prompt_logprobs=2)
    ours = await collect(engine, PROMPTS[2], max_tokens=5, temperature=0.0, logprobs=3, prompt_logprobs=2)
    assert theirs[0] == ours[0]
    a, b = theirs[1][0], ours[1][0]
    assert a.finish_reason == b.finish_reason == "length"
    first_a, first_b = theirs[2][0], ours[2][0]
    assert first_a.prompt_logprobs is not None and first_b.prompt_logprobs is not None
    assert [row and [t for t, _ in row] for row in first_a.prompt_logprobs] == \
           [row and [t for t, _ in row] for row in first_b.prompt_logprobs]
    scores_a = [lp for d in theirs[2] for lp in d.logprobs or []]
    scores_b = [lp for d in ours[2] for lp in d.logprobs or []]
    assert scores_a == pytest.approx(scores_b, abs=1e-5)


async def test_n_and_beam_search_cross_the_process(proc_engine: TorchEngine) -> None:
    tokens, last, _ = await collect(proc_engine, "Hello there", n=3, max_tokens=4, temperature=1.0, seed=7)
    assert sorted(tokens) == [0, 1, 2] and all(len(t) == 4 for t in tokens.values())
    beams, last, _ = await collect(proc_engine, "Hello there", n=2, max_tokens=4, temperature=0.0,
                                   use_beam_search=True)
    assert len(beams) == 2 and all(d.cumulative_logprob < 0 for d in last.values())


async def test_closing_the_stream_aborts_in_the_engine_process(proc_engine: TorchEngine) -> None:
    ids = proc_engine.tokenizer.encode("Once upon a time")
    request = GenerationRequest("leaves-early", ids, SamplingParams(max_tokens=300, ignore_eos=True, temperature=0))
    stream = proc_engine.generate(request)
    got = [await anext(stream) for _ in range(3)]
    assert all(d.finish_reason is None for d in got)
    await stream.aclose()  # type: ignore[attr-defined]
    await wait_idle(proc_engine)
    assert proc_engine.stats().slots_used == 0


async def test_an_error_there_fails_only_its_request(proc_engine: TorchEngine) -> None:
    empty = GenerationRequest("empty-prompt", [], SamplingParams(max_tokens=3))
    with pytest.raises(InvalidRequest, match="the prompt is empty"):
        [d async for d in proc_engine.generate(empty)]
    assert len(await greedy(proc_engine, "Still serving", max_tokens=3)) == 3


async def test_plugin_objects_cross_with_the_request(proc_engine: TorchEngine, engine: TorchEngine) -> None:
    """A closure factory (cloudpickle), holding the tokenizer (sent as a reference), and a guide."""
    tokenizer = proc_engine.tokenizer
    banned = (await greedy(engine, PROMPTS[0], max_tokens=1))[0]
    ids = tokenizer.encode(PROMPTS[0])
    request = GenerationRequest("banned", ids, SamplingParams(max_tokens=4, temperature=0.0),
                                logits_processors=(lambda: BanToken(banned, tokenizer),))
    got = [t for d in [d async for d in proc_engine.generate(request)] for t in d.token_ids]
    assert len(got) == 4 and banned not in got
    allowed = tuple(tokenizer.encode(" yes no maybe"))
    guided = GenerationRequest("guided", ids, SamplingParams(max_tokens=10, temperature=1.0, seed=3),
                               guided=AllowedTokens(allowed, steps=4))
    out = [d async for d in proc_engine.generate(guided)]
    tokens = [t for d in out for t in d.token_ids]
    assert len(tokens) == 4 and set(tokens) <= set(allowed) and out[-1].finish_reason == "stop"


async def test_an_unpicklable_plugin_object_is_a_clear_error(proc_engine: TorchEngine) -> None:
    lock = threading.Lock()
    request = GenerationRequest("unpicklable", [1, 2, 3], SamplingParams(max_tokens=2),
                                logits_processors=(lambda: lock,))  # type: ignore[arg-type, return-value]
    with pytest.raises(EngineError, match="--no-engine-process"):
        [d async for d in proc_engine.generate(request)]
    assert len(await greedy(proc_engine, "Still serving", max_tokens=2)) == 2


async def test_idle_engine_process_uses_no_cpu(proc_engine: TorchEngine) -> None:
    await greedy(proc_engine, "Warm", max_tokens=2)
    pid = proc_engine.runner.pid
    await asyncio.sleep(0.5)  # the request's own tail (the cache's pages faulted in ahead) can take 2-3 ticks
    before = cpu_ticks(pid)
    await asyncio.sleep(1.0)
    assert cpu_ticks(pid) - before <= 2  # clock ticks of 10 ms: it sleeps on its socket


async def test_shutdown_ends_the_process(smol_dir: Path) -> None:
    config = ServerConfig(engine_dir=str(smol_dir), engine="torch", dtype="float32", device="cpu", max_batch_size=2,
                          max_model_len=128, threads=1, engine_process=True)
    eng = TorchEngine(config)
    await eng.start()
    process = eng.runner._process
    ids = eng.tokenizer.encode("Once upon a time")
    stream = eng.generate(GenerationRequest("cut", ids, SamplingParams(max_tokens=200, ignore_eos=True)))
    await anext(stream)
    t0 = time.monotonic()
    await eng.shutdown()
    assert process.poll() == 0 and time.monotonic() - t0 < 10
    with pytest.raises(EngineError, match="shut down"):  # after the deltas already received
        async for _ in stream:
            pass


SERVER_SIDE_WITHOUT_TORCH = """
import asyncio, sys
from trtserver.config import ServerConfig
from trtserver.engine.base import GenerationRequest, SamplingParams
from trtserver.engine.torch.engine import TorchEngine

async def main():
    engine = TorchEngine(ServerConfig(engine_dir=sys.argv[1], engine="torch", max_batch_size=2, max_model_len=128,
                                      engine_process=True))
    await engine.start()
    ids = engine.tokenizer.encode("Once upon a time")
    tokens = []
    async for delta in engine.generate(GenerationRequest("r", ids, SamplingParams(max_tokens=4, ignore_eos=True))):
        tokens += delta.token_ids
    await engine.shutdown()
    print(len(tokens), engine.dtype_name, engine.info.fingerprint_inputs["quantization"], "torch" in sys.modules)

asyncio.run(main())
"""


def test_the_server_side_never_imports_torch(smol_dir: Path) -> None:
    """Device, dtype and quantization are settled in the engine process, which reports them."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", SERVER_SIDE_WITHOUT_TORCH, str(smol_dir)], capture_output=True,
                         text=True, timeout=300, check=True).stdout.split()
    tokens, dtype, quantization, imported = out
    assert tokens == "4" and dtype in ("bfloat16", "float32") and quantization in ("int4", "none")
    assert imported == "False"


# --- the wire ----------------------------------------------------------------------------------------


def test_step_messages_round_trip() -> None:
    outputs = [
        SequenceOutput("r1", 0, [5, 6], logprobs=[-0.5, -1.25], top_logprobs=[[(5, -0.5), (9, -2.0)], [(6, -1.25)]],
                       prompt_logprobs=[None, [(3, -0.75)]], prompt_token_logprobs=[None, -0.75],
                       num_prompt_tokens=2),
        SequenceOutput("r2", 1, [], finish_reason="stop", stop_token_id=7, cumulative_logprob=-3.5),
    ]
    failed: list[tuple[str, BaseException]] = [("r3", NotFound("no adapter 'x'", param="peft")),
                                               ("r4", ValueError("the prompt is empty"))]
    payload = ipc.encode_step(outputs, failed, EngineStats(running=2, waiting=1, slots_total=8, slots_used=3))
    assert isinstance(ipc.startup_decoder.decode(ipc.encode(ipc.Ready("float32", None, "cpu"))), ipc.Ready)
    got, errors, stats = ipc.decode_step(memoryview(payload))
    assert got == outputs
    assert stats == EngineStats(running=2, waiting=1, slots_total=8, slots_used=3)
    (rid3, e3), (rid4, e4) = errors
    assert rid3 == "r3" and type(e3) is NotFound and e3.param == "peft" and e3.message == "no adapter 'x'"
    assert rid4 == "r4" and type(e4) is EngineError and e4.message == "ValueError: the prompt is empty"


def test_requests_carry_the_tokenizer_as_a_reference(engine: TorchEngine) -> None:
    tokenizer = engine.tokenizer
    request = GenerationRequest("ref", [1, 2], SamplingParams(max_tokens=2, stop_token_ids=(4,)),
                                logits_processors=(lambda: BanToken(3, tokenizer),))
    message = ipc.encode_request(request, tokenizer)
    assert len(message) < 4096  # the tokenizer itself pickles to megabytes
    other = object()  # the engine process's own tokenizer
    rid, rebuilt = ipc.decode_request(memoryview(message), other)
    assert rid == "ref" and isinstance(rebuilt, GenerationRequest)
    assert rebuilt.sampling == request.sampling and rebuilt.prompt_token_ids == [1, 2]
    processor = rebuilt.logits_processors[0]()
    assert isinstance(processor, BanToken) and processor.tokenizer is other


def test_requests_without_plugin_objects_take_the_c_pickler(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_cloudpickle(*args: object, **kwargs: object) -> None:
        raise AssertionError("cloudpickle was used for a plain request")

    monkeypatch.setattr(ipc._RequestPickler, "dump", no_cloudpickle)  # noqa: SLF001
    request = GenerationRequest("plain", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.5, seed=7,
                                                                   logit_bias=((4, 1.5),), stop_token_ids=(9,)),
                                n=2, priority=Priority.HIGH, adapter="sql")
    rid, rebuilt = ipc.decode_request(memoryview(ipc.encode_request(request, object())), object())
    assert rid == "plain" and rebuilt == request


def test_commands_are_typed_messages(smol_dir: Path) -> None:
    """Every command decodes into its own Struct; the start message carries a checked ServerConfig."""
    import msgspec

    config = ServerConfig(engine_dir=str(smol_dir), engine="torch", max_batch_size=3)
    start = ipc.command_decoder.decode(ipc.encode(ipc.Start(config, 5, "none")))
    assert isinstance(start, ipc.Start) and start.config == config and start.seed == 5
    abort = ipc.command_decoder.decode(ipc.encode(ipc.Abort("r", 1)))
    assert abort == ipc.Abort("r", 1) and isinstance(ipc.command_decoder.decode(ipc.encode(ipc.Stop())), ipc.Stop)
    bad = ipc.encode(ipc.Start(config, 5, "none")).replace(b"max_batch_size", b"max_batch_sizX")
    with pytest.raises(msgspec.ValidationError):
        ipc.command_decoder.decode(bad)
