"""The fused CPU kernels (``kernels.cpp``) against the ATen calls they replace, and the fused small-batch
decode against the eager layers on the real SmolLM2 in int4. Elementwise kernels round where ATen rounds
(the same bits); reductions sum in their own order (within a bfloat16 step)."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tests.engine.test_model_families import make_checkpoint
from tests.engine.test_scripted_decode import MAX_LEN, _both_ways, _filled_cache, _run_both, _runner
from tests.support import NEEDS_BF16_PACKING
from trtserver.engine.torch.cache import KVCache
from trtserver.engine.torch.cpu import accelerate, kernels
from trtserver.engine.torch.cpu.scripted import ScriptedDecode
from trtserver.engine.torch.cpu.weights import pack_for_cpu, quantize_weights
from trtserver.engine.torch.model import Transformer, apply_rope, load_model

NH, NKV, HS = 9, 3, 64


def _bf16(*shape: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _within_a_step(got: Tensor, want: Tensor) -> None:
    """bfloat16: equal but for an odd element one rounding step apart; float32 (sums in another order): a few
    float32 steps apart."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6)
        return
    step = want.float().abs().clamp(min=1e-3) * 2 ** -7
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got != want).float().mean() < 0.01


DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])


@DTYPES
def test_rms_norm(ops, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    x, weight = _bf16(3, 576, dtype=dtype), 1 + 0.1 * _bf16(576, seed=1, dtype=dtype)
    want = F.rms_norm(x.float(), [576], None, 1e-5).to(dtype) * weight  # model.RMSNorm
    _within_a_step(ops.rms_norm(x, weight, 1e-5), want)


@DTYPES
def test_rope_cache_rotates_and_writes_exactly_where_asked(ops, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    qkv = _bf16(2, (NH + 2 * NKV) * HS, dtype=dtype)
    cos, sin = _bf16(2, HS, seed=1, dtype=dtype), _bf16(2, HS, seed=2, dtype=dtype)
    k_cache = torch.zeros(5, NKV, 40, HS, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots, positions = torch.tensor([3, 1]), torch.tensor([7, 20])
    q = ops.rope_cache(qkv, cos, sin, k_cache, v_cache, slots, positions, NH, NKV)
    qk, v = qkv.split([(NH + NKV) * HS, NKV * HS], dim=-1)
    rotated = apply_rope(qk.view(2, NH + NKV, HS), cos.view(2, 1, HS), sin.view(2, 1, HS))
    assert torch.equal(q, rotated[:, :NH])
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for b, (slot, pos) in enumerate(zip(slots.tolist(), positions.tolist(), strict=True)):
        want_k[slot, :, pos] = rotated[b, NH:]
        want_v[slot, :, pos] = v[b].view(NKV, HS)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)  # and nothing else written
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rope_cache(qkv, cos, sin, k_cache, v_cache, slots, torch.tensor([7, 40]), NH, NKV)
    with pytest.raises(RuntimeError, match="one slot and one position per row"):
        ops.rope_cache(qkv, cos, sin, k_cache, v_cache, slots[:1], positions, NH, NKV)
    with pytest.raises(RuntimeError, match="of one 4-d shape"):
        ops.rope_cache(qkv, cos, sin, k_cache, v_cache[:4], slots, positions, NH, NKV)
    with pytest.raises(RuntimeError, match="kv heads"):
        ops.rope_cache(qkv, cos, sin, k_cache, v_cache, slots, positions, NH, NKV + 1)
    with pytest.raises(RuntimeError, match="one slot and one position per row"):
        ops.decode_attention(q, k_cache, v_cache, slots, positions[:1])


@DTYPES
@pytest.mark.parametrize(("positions", "n_kv"), [([7, 20], NKV), ([300, 2], NKV), ([300], NKV), ([300, 2], 1)],
                         ids=["short", "long-threaded", "one-row-split", "split-with-an-empty-part"])
def test_decode_attention_is_the_masked_sdpa(ops, positions: list[int], n_kv: int,  # type: ignore[no-untyped-def]
                                             dtype: torch.dtype) -> None:
    """Long contexts split their positions across threads when rows x kv heads are too few to go round (one row:
    3 kv heads for 2 threads); a short row's part of a split can be empty."""
    B = len(positions)
    k_cache, v_cache = _bf16(5, n_kv, 320, HS, seed=1, dtype=dtype), _bf16(5, n_kv, 320, HS, seed=2, dtype=dtype)
    q, slots, pos = _bf16(B, NH, HS, seed=3, dtype=dtype), torch.tensor([3, 1][:B]), torch.tensor(positions)
    length = max(positions) + 1
    visible = (torch.arange(length) <= pos.view(B, 1)).view(B, 1, 1, length)
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    want = F.scaled_dot_product_attention(q.view(B, NH, 1, HS).float(), k_cache[slots, :, :length].float(),
                                          v_cache[slots, :, :length].float(), attn_mask=mask,
                                          enable_gqa=True).to(dtype).view(B, NH * HS)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _within_a_step(ops.decode_attention(q, k_cache, v_cache, slots, pos), want)
    finally:
        torch.set_num_threads(threads)


def test_decode_attention_keeps_a_nan_where_sdpa_does(ops) -> None:  # type: ignore[no-untyped-def]
    """The vectorised softmax clamps its exponents; a NaN score must not be clamped into a number."""
    k_cache, v_cache = _bf16(1, NKV, 128, HS, seed=1), _bf16(1, NKV, 128, HS, seed=2)
    k_cache[0, 0, 5, 0] = float("nan")
    out = ops.decode_attention(_bf16(1, NH, HS, seed=3), k_cache, v_cache, torch.tensor([0]), torch.tensor([100]))
    group = NH // NKV
    assert out.view(NH, HS)[:group].isnan().all() and out.view(NH, HS)[group:].isfinite().all()


def test_the_attention_threads_where_torch_has_openmp(ops) -> None:  # type: ignore[no-untyped-def]
    """``at::parallel_for`` in a library built without ``-fopenmp`` runs its whole range on the calling thread:
    long contexts then took the attention on one core (16.4 against 12.7 ms a step at 1500 tokens)."""
    name, flags = kernels.build_target()
    library = (kernels.build_directory(name) / f"{name}.so").read_bytes()
    threaded = sys.platform.startswith("linux") and torch.backends.openmp.is_available()
    assert ("-fopenmp" in flags) == threaded
    assert (b"GOMP_parallel" in library) == threaded  # the parallel region is an OpenMP one


def test_the_kernels_int4_layout_without_the_fused_kernels_scripts_the_aten_calls(smol_dir: Path, ops) -> None:  # type: ignore[no-untyped-def]
    """Without the fused kernels the scripted decode composes the ATen-call layers with the projections'
    own ``int4_linear``: the eager layers' bits. The fused decode on the same weights stays close to them."""
    model = load_model(smol_dir, torch.float32, torch.device("cpu"))
    quantize_weights(model, "int4", int4_kernel=True)
    model.setup_rope(MAX_LEN)
    decode = accelerate(model, fused=False)
    assert decode is not None and decode.covers(True) and not decode.fused_small
    _both_ways(model, decode, [0, 2], [9, 30], small=True)
    want, got, _, _ = _run_both(model, accelerate(model), [0, 2], [9, 30], small=True)
    _close(got, want)


def test_kernels_refuse_what_they_cannot_read(ops) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        ops.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match="bfloat16 or float32, as the op's first"):
        ops.rms_norm(torch.randn(2, 8), _bf16(8), 1e-5)  # two types
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.rms_norm(_bf16(8, 4).t(), _bf16(8), 1e-5)


MODEL_DTYPES = [pytest.param(torch.bfloat16, marks=NEEDS_BF16_PACKING, id="bf16"),
                pytest.param(torch.float32, id="f32")]


@pytest.fixture(scope="module", params=MODEL_DTYPES)
def smol_fused(smol_dir: Path, ops, request: pytest.FixtureRequest) -> tuple[Transformer, ScriptedDecode]:  # type: ignore[no-untyped-def]
    model = load_model(smol_dir, request.param, torch.device("cpu"))
    quantize_weights(model, "int4", int4_kernel=True)  # as the loader does where the kernels load
    model.setup_rope(MAX_LEN)
    decode = accelerate(model)
    # float32 batches keep the ATen calls
    assert decode is not None and decode.fused_small and decode.fused_batch == (request.param == torch.bfloat16)
    return model, decode


CASES = [([0], [5]), ([1, 2, 3], [40, 3, 17]), ([4, 0], [20, 33])]


def _close(got: Tensor, want: Tensor, bound: float = 0.06) -> None:
    """Thirty layers of sums in another order, where a last-bit difference can flip a bfloat16 rounding (of the
    activations, or of an int4 kernel's input) and grow from there: within a few percent. A float32 ulp of
    noise in the cache moves the eager layers themselves ~5 %."""
    error = (got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1)
    assert (error < bound).all(), error


def _deep_bound(model: Transformer) -> float:
    """How far the last layer may drift: in bfloat16 the fused feed-forward forms SiLU(gate) x up in float32
    where the eager layers round it twice to bfloat16, and over the random caches that difference, ~0.2 % from
    the second layer on, grows to 9-17 % by the thirtieth (the first layer's K/V equal, the pick the same)."""
    return 0.25 if model.tok_embeddings.weight.dtype == torch.bfloat16 else 0.06


def _agree(model: Transformer, slots: list[int], positions: list[int], want: Tensor, got: Tensor,
           eager_cache: KVCache, fused_cache: KVCache) -> None:
    """Hidden states, the next token and the K/V written in the first and last layers: all close."""
    deep = _deep_bound(model)
    _close(got, want, deep)
    eager = model.logits(want[:, 0])
    picked = model.logits(got[:, 0]).argmax(-1, keepdim=True)
    # the eager pick, or a near tie of it: the eager layers score it within 0.25 of their best
    assert (eager.gather(-1, picked)[:, 0] >= eager.max(-1).values - 0.25).all()
    for i in (0, len(eager_cache.k) - 1):
        bound = 0.06 if i == 0 else deep
        for slot, pos in zip(slots, positions, strict=True):
            _close(fused_cache.k[i][slot, :, pos].flatten(), eager_cache.k[i][slot, :, pos].flatten(), bound)
            _close(fused_cache.v[i][slot, :, pos].flatten(), eager_cache.v[i][slot, :, pos].flatten(), bound)


@pytest.mark.parametrize("small", [True, False], ids=["small-int4", "batch-packed"])
@pytest.mark.parametrize(("slots", "positions"), CASES)
def test_fused_decode_follows_the_eager_layers(smol_fused: tuple[Transformer, ScriptedDecode], slots: list[int],
                                               positions: list[int], small: bool) -> None:
    want, got, eager_cache, fused_cache = _run_both(*smol_fused, slots, positions, small=small)
    _agree(smol_fused[0], slots, positions, want, got, eager_cache, fused_cache)


@NEEDS_BF16_PACKING
@pytest.mark.parametrize(("slots", "positions"), CASES)
def test_fused_batch_decode_follows_the_eager_batch_path(smol_dir: Path, ops, slots: list[int],  # type: ignore[no-untyped-def]
                                                         positions: list[int]) -> None:
    model = load_model(smol_dir, torch.bfloat16, torch.device("cpu"))
    pack_for_cpu(model)  # unquantized: only the batch path is scripted
    model.setup_rope(MAX_LEN)
    decode = accelerate(model)
    assert decode is not None and decode.fused_batch and not decode.covers(True)
    want, got, eager_cache, fused_cache = _run_both(model, decode, slots, positions, small=False)
    _agree(model, slots, positions, want, got, eager_cache, fused_cache)


@NEEDS_BF16_PACKING
def test_without_the_kernels_the_scripted_aten_calls_run(smol_dir: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(kernels, "load", lambda **_: False)  # no compiler on this machine
    model = load_model(smol_dir, torch.bfloat16, torch.device("cpu"))
    quantize_weights(model, "int8")
    decode = accelerate(model)
    assert decode is not None and (decode.fused_small, decode.fused_batch) == (False, False)
    assert decode.covers(True) and decode.covers(False)


def test_fused_int8_with_qkv_biases_follows_the_eager_layers(tmp_path: Path, ops) -> None:  # type: ignore[no-untyped-def]
    make_checkpoint(tmp_path, "qwen2")  # head_dim 16, two kv heads for four query heads, q/k/v biases
    model = load_model(tmp_path, torch.bfloat16, torch.device("cpu"))
    quantize_weights(model, "int8")
    model.setup_rope(MAX_LEN)
    decode = accelerate(model)
    assert decode is not None and decode.fused_small
    want, got, _, _ = _run_both(model, decode, [2, 0], [9, 30], small=True)
    assert torch.allclose(got.float(), want.float(), rtol=0.05, atol=0.05 * want.float().abs().max().item())


def test_the_environments_own_ninja_is_found_without_activating_it(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import ninja

    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)  # no ninja on PATH
    kernels._ninja_on_path()
    assert os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR
    assert (Path(ninja.BIN_DIR) / "ninja").exists()


def test_a_build_that_runs_too_long_costs_the_kernels_not_the_start(tmp_path: Path, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built here yet
    monkeypatch.setattr(kernels, "loaded", lambda: False)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        assert kernels.load(timeout_s=0.5) is False
    assert time.monotonic() - t0 < 5
    assert "was stopped" in caplog.text


def test_a_stale_build_lock_is_cleared_before_building(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import torch.utils.cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = kernels.build_directory(kernels.build_target()[0])
    directory.mkdir(parents=True)
    lock = directory / "lock"  # left by a build that was killed: torch's next build would wait on it forever
    lock.touch()
    os.utime(lock, (time.time() - 2 * kernels.STALE_LOCK_S,) * 2)
    seen: list[bool] = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **_: seen.append(lock.exists()))
    kernels.build()
    assert seen == [False]


def test_a_native_build_leaves_amx_out(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Some machines report AMX whose tile instructions die with SIGILL: ``-march=native`` never goes alone."""
    import torch.utils.cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    seen: list[list[str]] = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: seen.append(kw["extra_cflags"]))
    kernels.build()
    if "-march=native" in seen[0]:
        assert kernels._no_amx_flags() == list(kernels.AMX_OFF)  # this machine's compiler knows AMX (gcc 11+)
        assert set(kernels.AMX_OFF) <= set(seen[0])


@pytest.mark.parametrize(("slots", "positions"), CASES)
def test_the_bfloat16_batch_layers_composed_in_float32_follow_the_eager_batch_path(
        smol_dir: Path, ops, slots: list[int], positions: list[int]) -> None:  # type: ignore[no-untyped-def]
    """The batch path a bfloat16 server scripts (fused RMSNorm and RoPE / K/V write, the bmm reading the dense
    buffers where the slots are consecutive), composed on float32 weights, which every x86-64 CPU packs."""
    from trtserver.engine.torch.cpu.scripted import PathKind, _path

    model = load_model(smol_dir, torch.float32, torch.device("cpu"))
    pack_for_cpu(model)
    model.setup_rope(MAX_LEN)
    decode = ScriptedDecode(model, None, _path(model, PathKind("packed", "bmm", fused=True)))
    assert decode.fused_batch
    tokens = torch.tensor([[7 + 3 * i] for i in range(len(slots))])
    eager_cache, fused_cache = _filled_cache(model), _filled_cache(model)
    eager, fused = _runner(model, eager_cache, None), _runner(model, fused_cache, decode)
    fused.dense = (torch.full((1 << 18,), float("nan")), torch.full((1 << 18,), float("nan")))
    with torch.inference_mode():
        want = eager.forward(tokens, eager.decode_context(slots, positions, small=False))
        got = fused.forward(tokens, fused.decode_context(slots, positions, small=False))
    _agree(model, slots, positions, want, got, eager_cache, fused_cache)
