"""The int4 projections and the refined int4 output head of the CPU engine's small-batch path."""

from __future__ import annotations

import torch
from torch import nn

from trtserver.engine.torch.cpu.weights import Int4Head, Int4Linear, KernelSwitch


def _grid_linear(out_features: int, in_features: int, seed: int = 0) -> nn.Linear:
    """A bfloat16 linear whose weights lie on a 4-bit grid per group of 32 (as a Q4_1 GGUF's do)."""
    g = torch.Generator().manual_seed(seed)
    groups = in_features // 32
    q = torch.randint(0, 16, (out_features, groups, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # each block uses its whole range, as Q4_1's min/max do
    scale = torch.rand(out_features, groups, 1, generator=g) * 0.01 + 0.001
    low = -8 * scale + torch.randn(out_features, groups, 1, generator=g) * 0.002
    lin = nn.Linear(in_features, out_features, bias=False)
    lin.weight.data = (low + scale * q).view(out_features, in_features).to(torch.bfloat16)
    return lin


@torch.inference_mode()
def test_int4_serves_only_small_batches_and_reads_a_4bit_grid_back() -> None:
    lin = _grid_linear(96, 128)
    switch = KernelSwitch()
    q = Int4Linear(lin, switch)
    x = torch.randn(3, 128).to(torch.bfloat16)
    exact = x.float() @ lin.weight.float().t()
    assert torch.equal(q(x), q.dense(x))  # the switch off: the bfloat16 GEMM itself
    switch.small = True
    int4 = q(x).float()
    assert not torch.equal(int4, q.dense(x).float())  # the int4 kernel ran
    assert (int4 - exact).abs().max() <= 0.02 * exact.abs().max()


@torch.inference_mode()
def test_refined_head_keeps_the_bfloat16_logits_of_its_best_tokens() -> None:
    g = torch.Generator().manual_seed(1)
    vocab, dim = 4096, 64
    lin = nn.Linear(dim, vocab, bias=False)
    lin.weight.data = (torch.randn(vocab, dim, generator=g) * 0.1).to(torch.bfloat16)  # not on a 4-bit grid
    switch = KernelSwitch(small=True)
    head = Int4Head(lin, switch)
    x = torch.randn(2, 1, dim, generator=g).to(torch.bfloat16)
    got = head(x).float().view(2, vocab)
    dense = (x.float().view(2, dim) @ lin.weight.float().t())
    best = dense.topk(16, dim=-1).indices
    # the tokens that can win have their bfloat16 logits (up to the output's bfloat16 rounding) ...
    assert torch.allclose(got.gather(1, best), dense.gather(1, best), rtol=1e-2, atol=1e-2)
    assert torch.equal(got.argmax(-1), dense.argmax(-1))
    # ... and the rest keep the int4 kernel's approximation
    plain = Int4Linear(lin, switch)(x).float().view(2, vocab)
    rest = torch.ones_like(got, dtype=torch.bool).scatter_(1, plain.topk(Int4Head.REFINE, dim=-1).indices, False)
    assert torch.equal(got[rest], plain[rest])
