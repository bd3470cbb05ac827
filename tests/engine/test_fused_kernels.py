"""The fused CPU kernels (``kernels.cpp``) against the ATen calls they replace, and the fused small-batch
decode against the eager layers on the real SmolLM2 in int4. Elementwise kernels round where ATen rounds
(the same bits); reductions sum in their own order (within a bfloat16 step)."""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

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


@pytest.fixture(scope="module")
def ops() -> object:
    assert kernels.load(), "the fused kernels did not build (is a C++ compiler installed?)"
    return torch.ops.trtserver


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


def _int4_weights(n: int, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Random 4-bit weights in the kernel's layout: (packed, scales_mins, the float32 weights they stand for)."""
    from trtserver.engine.torch.cpu.weights import int4_kernel_layout

    g = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g, dtype=torch.uint8)
    # float16 scales and mins, as the layout keeps them
    scale, low = (t.half().float() for t in (torch.rand(n, k // 32, 1, generator=g) / 8,
                                             torch.randn(n, k // 32, 1, generator=g)))
    packed, scales_mins = int4_kernel_layout(q, scale.squeeze(-1), low.squeeze(-1))
    return packed, scales_mins, (q.float() * scale + low).view(n, k)


def _relative_error(got: Tensor, want: Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_int4_linear_is_the_matmul_of_its_weights(ops, rows: int) -> None:  # type: ignore[no-untyped-def]
    """Four rows at a time share a block's unpacking; more rows take further passes. With AVX2 each block of
    the activations is scaled to int16 (within 2^-16 of its largest value): far inside bfloat16's 2^-9."""
    packed, scales_mins, weight = _int4_weights(200, 576)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(5))
    want = x.double() @ weight.double().t()
    got = ops.int4_linear(x, packed, scales_mins)
    assert got.dtype == torch.float32 and _relative_error(got, want) < 1e-4
    rounded = x.to(torch.bfloat16).double() @ weight.double().t()  # what a kernel on bfloat16 activations reads
    assert _relative_error(got, want) < _relative_error(rounded, want) / 10
    tiny = x * 1e-36  # blocks too small to scale to int16 keep their min term, and nothing overflows
    small = ops.int4_linear(tiny, packed, scales_mins).double()
    assert (small - tiny.double() @ weight.double().t()).abs().max() < 1e-33
    xb = x.to(torch.bfloat16)  # bfloat16 activations are widened, the result rounded to bfloat16
    got = ops.int4_linear(xb, packed, scales_mins)
    assert got.dtype == torch.bfloat16 and _relative_error(got, xb.double() @ weight.double().t()) < 2 ** -8


@pytest.mark.parametrize("rows", [1, 5])
def test_int4_gated_linear_projects_silu_of_gate_times_up(ops, rows: int) -> None:  # type: ignore[no-untyped-def]
    """The feed-forward's down projection with SiLU(gate) * up formed inside: as the ATen calls then the
    projection, within its exp's rounding; gates far out on either side included."""
    packed, scales_mins, _ = _int4_weights(64, 160)
    gate_up = torch.randn(rows, 320, generator=torch.Generator().manual_seed(8)) * 4
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    want = ops.int4_linear((torch.nn.functional.silu(gate) * up).contiguous(), packed, scales_mins)
    got = ops.int4_gated_linear(gate_up, packed, scales_mins)
    assert _relative_error(got, want) < 1e-5
    with pytest.raises(RuntimeError, match="2K"):
        ops.int4_gated_linear(gate_up[:, :160].contiguous(), packed, scales_mins)


def test_int4_linear_refuses_what_it_cannot_read(ops) -> None:  # type: ignore[no-untyped-def]
    packed, scales_mins, _ = _int4_weights(16, 96)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.int4_linear(torch.randn(1, 48), packed, scales_mins)
    with pytest.raises(RuntimeError, match=r"uint8 \(N / 8, K / 32, 128\)"):
        ops.int4_linear(torch.randn(1, 96), packed.view(16, 48), scales_mins)
    with pytest.raises(RuntimeError, match="scales_mins"):
        ops.int4_linear(torch.randn(1, 96), packed[:1].contiguous(), scales_mins)  # 8 features' weights, 16's scales
    with pytest.raises(RuntimeError, match="scales_mins"):
        ops.int4_linear(torch.randn(1, 96), packed, scales_mins.transpose(2, 3).contiguous())  # (N / 8, K / 32, 8, 2)
    with pytest.raises(RuntimeError, match="float16"):
        ops.int4_linear(torch.randn(1, 96), packed, scales_mins.float())


def test_the_int4_kernels_layout_takes_output_features_in_eights() -> None:
    """The layout refuses a width it cannot group, and the engine takes it only for models whose widths fit."""
    from trtserver.engine.torch.cpu.weights import fits_int4_kernel, int4_kernel_layout
    from trtserver.engine.torch.model import ModelArgs

    smol_shapes = ModelArgs(vocab_size=49152, dim=576, n_layers=1, n_heads=9, n_kv_heads=3, head_dim=64,
                            intermediate_size=1536)

    q, ones = torch.zeros(12, 3, 32, dtype=torch.uint8), torch.ones(12, 3)
    with pytest.raises(ValueError, match="multiples of 8"):
        int4_kernel_layout(q, ones, ones)
    packed, scales_mins = int4_kernel_layout(q[:8], ones[:8], ones[:8] * 2)
    assert fits_int4_kernel(SimpleNamespace(args=smol_shapes))  # type: ignore[arg-type]
    assert not fits_int4_kernel(SimpleNamespace(args=replace(smol_shapes, vocab_size=49153)))  # type: ignore[arg-type]
    assert packed.shape == (1, 3, 128) and scales_mins.shape == (1, 3, 2, 8)
    assert scales_mins.dtype == torch.float16
    assert (scales_mins[:, :, 0] == 1).all() and (scales_mins[:, :, 1] == 2).all()


def test_int4_kernel_layout_holds_the_weights_atens_layout_holds(ops) -> None:  # type: ignore[no-untyped-def]
    """``Int4Linear`` in either layout on the same weights: the same grid, read with float32 activations in
    the kernel's and with bfloat16 ones in ATen's."""
    from trtserver.engine.torch.cpu.weights import Int4Linear, KernelSwitch

    linear = torch.nn.Linear(576, 96, bias=True)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        linear.weight.copy_(torch.rand(96, 576, generator=g) / 12 - 1 / 24)
        linear.bias.copy_(torch.rand(96, generator=g) / 12)
    switch = KernelSwitch(small=True)
    ours, atens = Int4Linear(linear, switch, kernel_layout=True), Int4Linear(linear, switch)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        got = ours(x)
        torch.testing.assert_close(got, atens(x.to(torch.bfloat16).float()), rtol=0.02, atol=0.02)
        exact = linear(x)
        assert (got - exact).norm() < 0.1 * exact.norm()  # and near the float32 weights (16 levels a block)


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


def _close(got: Tensor, want: Tensor) -> None:
    """Thirty layers of sums in another order, where a last-bit difference can flip a bfloat16 rounding (of the
    activations, or of an int4 kernel's input) and grow from there: within a few percent. A float32 ulp of
    noise in the cache moves the eager layers themselves ~5 %."""
    error = (got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1)
    assert (error < 0.06).all(), error


def _agree(model: Transformer, slots: list[int], positions: list[int], want: Tensor, got: Tensor,
           eager_cache: KVCache, fused_cache: KVCache) -> None:
    """Hidden states, the next token and the K/V written in the first and last layers: all close."""
    _close(got, want)
    eager = model.logits(want[:, 0])
    picked = model.logits(got[:, 0]).argmax(-1, keepdim=True)
    # the eager pick, or a near tie of it: the eager layers score it within 0.25 of their best
    assert (eager.gather(-1, picked)[:, 0] >= eager.max(-1).values - 0.25).all()
    for i in (0, len(eager_cache.k) - 1):
        for slot, pos in zip(slots, positions, strict=True):
            _close(fused_cache.k[i][slot, :, pos].flatten(), eager_cache.k[i][slot, :, pos].flatten())
            _close(fused_cache.v[i][slot, :, pos].flatten(), eager_cache.v[i][slot, :, pos].flatten())


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
