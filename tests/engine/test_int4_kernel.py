"""``int4.cpp``'s ops (``int4_linear``, ``int4_gated_linear``) against the float64 matmul of the weights they
hold, and the layout ``weights.int4_kernel_layout`` writes for them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import Tensor


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
    assert fits_int4_kernel(smol_shapes)
    assert not fits_int4_kernel(replace(smol_shapes, vocab_size=49153))
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


def test_one_row_gives_the_same_bits_on_either_loop_and_start_up_keeps_one(ops) -> None:  # type: ignore[no-untyped-def]
    """With AVX-512 one row can take the 512-bit loop or the 256-bit one (``kernels.pick_int4_loop`` times both
    at start-up); they sum the same integers. A build without AVX-512 has only the 256-bit loop."""
    from trtserver.engine.torch.cpu.kernels import pick_int4_loop

    packed, scales_mins, _ = _int4_weights(200, 576)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(6))
    before = ops.int4_wide_from_rows(2)
    try:
        has_wide = ops.int4_wide_from_rows(1) == 1
        wide = ops.int4_linear(x, packed, scales_mins)
        ops.int4_wide_from_rows(2)
        narrow = ops.int4_linear(x, packed, scales_mins)
        assert torch.equal(wide, narrow)
        picked = pick_int4_loop(packed, scales_mins, rounds=3)
        assert picked in ((1, 2) if has_wide else (2,))
        assert ops.int4_wide_from_rows(picked) == picked
        assert has_wide == ("avx512bw" in Path("/proc/cpuinfo").read_text())
    finally:
        ops.int4_wide_from_rows(before)
