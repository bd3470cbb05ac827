"""The scripted decode (``cpu/scripted.py``), as the model runner calls it, against the eager layers it stands
in for: the same hidden states and the same K/V written, bit for bit, on both of its paths (small
batches with int4 / int8 projections; larger batches and unquantized models with pre-packed ones), on
the real SmolLM2 and on tiny Llama / Qwen2 (q/k/v biases) checkpoints; and the models and batches it
must leave to the eager layers."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from tests.engine.test_model_families import make_checkpoint
from tests.support import NEEDS_BF16_PACKING
from trtserver.engine.torch.cache import KVCache
from trtserver.engine.torch.cpu import accelerate
from trtserver.engine.torch.cpu.scripted import ScriptedDecode
from trtserver.engine.torch.cpu.weights import pack_for_cpu, quantize_weights
from trtserver.engine.torch.model import ForwardContext, Transformer, load_model
from trtserver.engine.torch.model_runner import ModelRunner

SLOTS, MAX_LEN = 6, 96


def _filled_cache(model: Transformer) -> KVCache:
    a, dtype = model.args, model.tok_embeddings.weight.dtype
    cache = KVCache(a.n_layers, SLOTS, a.n_kv_heads, MAX_LEN, a.head_dim, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for t in (*cache.k, *cache.v):  # earlier tokens' keys and values for attention to read
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return cache


def _runner(model: Transformer, cache: KVCache, decode: ScriptedDecode | None) -> ModelRunner:
    return ModelRunner(model, cache, device=torch.device("cpu"), max_len=MAX_LEN, decode=decode)


def _run_both(model: Transformer, fast: ScriptedDecode | None, slots: list[int], positions: list[int], *,
              small: bool, eager_small: bool | None = None) -> tuple[Tensor, Tensor, KVCache, KVCache]:
    """(eager hidden, scripted hidden, eager cache, scripted cache) for one decode step, each through a
    runner (one without the scripted decode); the eager one on the small-batch path or not as
    ``eager_small`` says (default: as the scripted one). The quantized projections are left on the
    scripted one's path, for the ``logits`` after."""
    assert fast is not None and fast.covers(small)
    tokens = torch.tensor([[7 + 3 * i] for i in range(len(slots))])
    eager_cache, script_cache = _filled_cache(model), _filled_cache(model)
    eager, script = _runner(model, eager_cache, None), _runner(model, script_cache, fast)
    with torch.inference_mode():
        eager_ctx = eager.decode_context(slots, positions, small=small if eager_small is None else eager_small)
        want = eager.forward(tokens, eager_ctx)
        got = script.forward(tokens, script.decode_context(slots, positions, small=small))
    return want, got, eager_cache, script_cache


def _both_ways(model: Transformer, fast: ScriptedDecode | None, slots: list[int], positions: list[int], *,
               small: bool) -> None:
    want, got, eager_cache, script_cache = _run_both(model, fast, slots, positions, small=small)
    assert torch.equal(got, want)
    for mine, theirs in zip((*script_cache.k, *script_cache.v), (*eager_cache.k, *eager_cache.v), strict=True):
        assert torch.equal(mine, theirs)  # every layer's K/V written at the same rows, with the same bits
    assert not torch.equal(script_cache.k[0], _filled_cache(model).k[0])  # and written they were


@pytest.fixture(scope="module", params=[pytest.param(torch.bfloat16, marks=NEEDS_BF16_PACKING), torch.float32])
def smol_int4(smol_dir: Path, request: pytest.FixtureRequest) -> tuple[Transformer, ScriptedDecode]:
    """SmolLM2 with int4 small-batch projections, in bfloat16 and in float32 (whose activations the int4
    kernel takes rounded to bfloat16)."""
    model = load_model(smol_dir, request.param, torch.device("cpu"))
    quantize_weights(model, "int4")
    model.setup_rope(MAX_LEN)
    decode = accelerate(model, fused=False)  # the same ATen calls as eager: the same bits
    assert decode is not None and not decode.fused_small
    return model, decode


CASES = [
    ([0], [5]),  # one row
    ([1, 2, 3], [40, 3, 17]),  # consecutive slots: the cache read through a view; shorter rows masked
    ([4, 0], [20, 33]),  # scattered slots: the keys gathered
]


@pytest.mark.parametrize("small", [True, False], ids=["small-int4", "batch-packed"])
@pytest.mark.parametrize(("slots", "positions"), CASES)
def test_smollm2_int4_scripted_decode_is_the_eager_one(smol_int4: tuple[Transformer, ScriptedDecode],
                                                       slots: list[int], positions: list[int], small: bool) -> None:
    _both_ways(*smol_int4, slots, positions, small=small)


@NEEDS_BF16_PACKING
def test_int8_with_qkv_biases_is_the_eager_one(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "qwen2")
    model = load_model(tmp_path, torch.bfloat16, torch.device("cpu"))
    quantize_weights(model, "int8")
    model.setup_rope(MAX_LEN)
    assert model.layers[0].attention.wqkv.bias is not None  # type: ignore[union-attr]
    decode = accelerate(model, fused=False)
    for small in (True, False):
        _both_ways(model, decode, [2, 0], [9, 30], small=small)
        _both_ways(model, decode, [0, 1], [9, 30], small=small)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=NEEDS_BF16_PACKING), torch.float32])
def test_unquantized_models_script_only_the_batch_path(tmp_path: Path, dtype: torch.dtype) -> None:
    make_checkpoint(tmp_path, "llama")
    model = load_model(tmp_path, dtype, torch.device("cpu"))
    pack_for_cpu(model)
    model.setup_rope(MAX_LEN)
    decode = accelerate(model, fused=False)
    assert decode is not None and not decode.covers(True)  # no small-batch kernels here
    _both_ways(model, decode, [1, 2, 3], [40, 3, 17], small=False)
    _both_ways(model, decode, [3, 0, 5], [40, 3, 17], small=False)


def test_prefill_and_adapter_batches_keep_the_eager_layers(smol_int4: tuple[Transformer, ScriptedDecode],
                                                           monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def refuse(*args: object) -> torch.Tensor:
        raise AssertionError("the scripted decode ran")

    model, decode = smol_int4
    monkeypatch.setattr(ScriptedDecode, "__call__", refuse)
    cache = _filled_cache(model)
    runner = _runner(model, cache, decode)
    with torch.inference_mode():
        pos = torch.arange(4).unsqueeze(0)
        runner.forward(torch.ones(1, 4, dtype=torch.long), ForwardContext(pos, torch.tensor([0]), 0, 4, None,
                                                                          causal=True))
        one = torch.ones(1, 1, dtype=torch.long)
        runner.forward(one, runner.decode_context([0], [4], small=True), adapters=True)
        with pytest.raises(AssertionError, match="scripted decode ran"):  # while a decode does take it
            runner.forward(one, runner.decode_context([0], [4], small=True))


def test_wrapped_projections_are_left_to_the_eager_layers(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "llama")
    model = load_model(tmp_path, torch.bfloat16, torch.device("cpu"))
    quantize_weights(model, "int8")

    class Wrapper(nn.Module):  # what LoRA does to a projection
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

    model.layers[1].feed_forward.w2 = Wrapper(model.layers[1].feed_forward.w2)  # type: ignore[union-attr]
    assert accelerate(model) is None


def test_no_torchscript_leaves_the_eager_layers(tmp_path: Path, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    make_checkpoint(tmp_path, "llama")
    model = load_model(tmp_path, torch.bfloat16, torch.device("cpu"))
    quantize_weights(model, "int8")

    def broken(fn: object) -> object:
        raise RuntimeError("no TorchScript here")

    monkeypatch.setattr(torch.jit, "script", broken)
    with caplog.at_level(logging.WARNING):
        assert accelerate(model) is None
    assert "eager layers" in caplog.text
    monkeypatch.delattr(torch.jit, "script")
    assert accelerate(model) is None


def test_scattered_slots_gather_only_their_live_positions() -> None:
    """A decode batch on non-consecutive slots reads each slot's first ``length`` positions: gathering
    whole slots first read the full context of every row, every layer (gigabytes at 8k positions)."""
    from trtserver.engine.torch.cpu.decode_layers import _live

    def rss_mib() -> float:
        status = Path("/proc/self/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) / 1024

    cache = KVCache(1, 6, 2, 1 << 20, 64, torch.float32, torch.device("cpu"))  # 512 MiB a slot, untouched
    k = cache.k[0]
    k[:, :, :16] = torch.arange(7.0).view(7, 1, 1, 1)  # slot i holds i (slot 6 is the scratch)
    slots = torch.tensor([1, 4, 5])
    before = rss_mib()
    live = _live(k, slots, -1, 3, 16)
    assert rss_mib() - before < 64  # whole slots would be 1.5 GiB
    assert live.shape == (3, 2, 16, 64) and live[:, 0, 0, 0].tolist() == [1.0, 4.0, 5.0]
    assert torch.equal(_live(k, slots, 3, 3, 16), k[3:6, :, :16])
