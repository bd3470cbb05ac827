"""What a request brings that takes long to get ready (a LoRA adapter read from disk, a guide compiled
again in the engine process) is done off the engine's step loop: a running stream keeps its pace.

Each test runs a greedy stream, measures its inter-token gaps while idle, then submits the slow
request and measures the stream's gaps until that request's first token arrives.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import cloudpickle
import pytest
import pytest_asyncio
import torch

from tests.support import AllowedTokens
from trtserver.config import ServerConfig
from trtserver.engine.base import GenerationRequest, SamplingParams, SequenceOutput
from trtserver.engine.torch.engine import TorchEngine

_ids = iter(range(10**9))
RANK = 64  # all seven projections of the 30 blocks: ~78 MB of float32 matrices


@pytest.fixture(scope="module")
def big_adapter_dir(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Path:
    """One PEFT-format adapter as big as the ones users load, random but well-formed."""
    from safetensors.torch import save_file

    cfg = json.loads((smol_dir / "config.json").read_text())
    dim, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = dim // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj": (dim, dim), "self_attn.k_proj": (dim, kv), "self_attn.v_proj": (dim, kv),
              "self_attn.o_proj": (dim, dim), "mlp.gate_proj": (dim, inter), "mlp.up_proj": (dim, inter),
              "mlp.down_proj": (inter, dim)}
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(layers):
        for module, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=gen) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=gen) * 0.01
    root = tmp_path_factory.mktemp("big-adapters")
    for name in ("big", "big2"):
        (root / name).mkdir()
        save_file(tensors, str(root / name / "adapter_model.safetensors"))
        (root / name / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": RANK, "lora_alpha": 16, "bias": "none",
            "target_modules": [m.split(".")[1] for m in shapes]}))
    return root


@pytest.fixture(scope="module")
def lora_engine(smol_dir: Path, big_adapter_dir: Path) -> Iterator[TorchEngine]:
    eng = TorchEngine.from_dir(smol_dir, dtype="float32", device="cpu", max_batch_size=4, max_model_len=256,
                               prefill_chunk_size=16, seed=0, threads=1, adapters_dir=str(big_adapter_dir))
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.shutdown())


@pytest_asyncio.fixture(scope="module")
async def proc_engine(smol_dir: Path) -> AsyncIterator[TorchEngine]:
    config = ServerConfig(engine_dir=str(smol_dir), engine="torch", dtype="float32", device="cpu", max_batch_size=4,
                          max_model_len=256, prefill_chunk_size=16, threads=1, engine_process=True)
    eng = TorchEngine(config, seed=0)
    await eng.start()
    yield eng
    await eng.shutdown()


def _rebuild_slowly(allowed: frozenset[int], seconds: float) -> AllowedTokens:
    time.sleep(seconds)  # as a compile waits on its compiler (outlines' runs in a subprocess)
    return AllowedTokens(allowed)


cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the engine process cannot import this file


class SlowToRebuild(AllowedTokens):
    """A guide that takes ``seconds`` to be rebuilt in the engine process, as a compiled one does."""

    def __init__(self, allowed: frozenset[int], seconds: float) -> None:
        super().__init__(allowed)
        self.seconds = seconds

    def __reduce__(self) -> tuple[object, tuple[frozenset[int], float]]:
        return _rebuild_slowly, (self.allowed, self.seconds)


async def gaps_while(engine: TorchEngine, slow: GenerationRequest) -> tuple[list[float], list[float], float]:
    """(idle gaps, gaps while ``slow`` gets ready, seconds until its first token) of a greedy stream."""
    stream = GenerationRequest(f"stream{next(_ids)}", engine.tokenizer.encode("Once upon a time, a small robot"),
                               SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    times: list[float] = []
    window: list[float] = []

    async def consume_stream() -> None:
        async for _ in engine.generate(stream):
            times.append(time.perf_counter())
            if window and len(window) == 2:
                return

    async def slow_one() -> None:
        window.append(time.perf_counter())
        async for _ in engine.generate(slow):
            break
        window.append(time.perf_counter())

    task = asyncio.create_task(consume_stream())
    while len(times) < 30:
        await asyncio.sleep(0.005)
    idle = [b - a for a, b in zip(times[10:], times[11:])]
    await slow_one()
    await asyncio.wait_for(task, 120)
    start, end = window
    inside = [t for t in times if t > start]
    during = [b - a for a, b in zip([start, *inside], inside)][: sum(t <= end for t in inside) + 1]
    return idle, during, end - start


def check_pace(idle: list[float], during: list[float], wait: float) -> None:
    median_idle = statistics.median(idle)
    assert wait > 5 * median_idle, f"getting ready took {wait:.3f} s: too quick to show a stall"
    assert during, "no token of the stream arrived while the slow request got ready"
    assert max(during) < wait / 2, f"the stream stalled: max gap {max(during):.3f} s of a {wait:.3f} s wait"
    assert statistics.median(during) <= 2 * median_idle, (statistics.median(during), median_idle)


async def test_loading_an_adapter_does_not_stall_running_streams(lora_engine: TorchEngine) -> None:
    slow = GenerationRequest(f"adapter{next(_ids)}", lora_engine.tokenizer.encode("Hello"),
                             SamplingParams(max_tokens=2, temperature=0.0), adapter="big")
    idle, during, wait = await gaps_while(lora_engine, slow)
    check_pace(idle, during, wait)
    assert lora_engine.lora is not None and lora_engine.lora.is_loaded("big")


async def test_an_adapter_that_fails_to_load_fails_its_request_only(lora_engine: TorchEngine,
                                                                    big_adapter_dir: Path) -> None:
    from trtserver.errors import InvalidRequest

    (big_adapter_dir / "broken").mkdir(exist_ok=True)
    (big_adapter_dir / "broken" / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    (big_adapter_dir / "broken" / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules": ["q_proj"]}))
    bad = GenerationRequest(f"broken{next(_ids)}", [1, 2, 3], SamplingParams(max_tokens=2), adapter="broken")
    with pytest.raises(InvalidRequest) as info:
        [d async for d in lora_engine.generate(bad)]
    assert info.value.param == "peft"
    assert lora_engine.stats().waiting == 0


async def test_a_request_aborted_while_its_adapter_loads_ends(lora_engine: TorchEngine) -> None:
    request = GenerationRequest(f"abort{next(_ids)}", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True),
                                adapter="big2", n=2)
    reasons = {}
    async for delta in _abort_first(lora_engine, request):
        if delta.finish_reason:
            reasons[delta.index] = delta.finish_reason
    assert reasons == {0: "abort", 1: "length"}
    for _ in range(300):
        if lora_engine.stats().slots_used == 0 and lora_engine.stats().waiting == 0:
            break
        await asyncio.sleep(0.01)
    assert lora_engine.stats().slots_used == 0 and lora_engine.stats().waiting == 0


async def _abort_first(engine: TorchEngine, request: GenerationRequest) -> AsyncIterator[SequenceOutput]:
    stream = engine.generate(request)
    first = asyncio.ensure_future(anext(stream))
    for _ in range(100):
        await asyncio.sleep(0.01)
        if engine.stats().waiting == 1:  # still preparing: its adapter is loading
            break
    assert engine.stats().waiting == 1 and engine.stats().slots_used == 0
    engine.abort(request.request_id, 0)
    yield await first
    async for delta in stream:
        yield delta


async def test_rebuilding_a_guide_in_the_engine_process_does_not_stall_streams(proc_engine: TorchEngine) -> None:
    allowed = frozenset(proc_engine.tokenizer.encode(" yes no maybe"))
    slow = GenerationRequest(f"guide{next(_ids)}", proc_engine.tokenizer.encode("Answer:"),
                             SamplingParams(max_tokens=2, temperature=0.0), guided=SlowToRebuild(allowed, 1.5))
    idle, during, wait = await gaps_while(proc_engine, slow)
    check_pace(idle, during, wait)
