"""Weight formats of the CPU engine: oneDNN's pre-packed bfloat16 and weight-only int4 / int8.

The quantized projections serve only the small-batch path (``KernelSwitch``, which the model runner sets
before each forward); each keeps a pre-packed bfloat16 copy for prefill and larger batches.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Union, cast

import torch
from torch import Tensor, nn

from trtserver.engine.torch.model import Block, ModelArgs, Transformer


@dataclass(slots=True)
class KernelSwitch:
    """Shared by a model's quantized projections: whether the forward under way (and the ``logits``
    after it) takes the small-batch kernels. The runner sets it from ``ForwardContext.small``."""

    small: bool = False

# ---- the projections' computations, one function each (the eager modules' and the scripted decode's) ----

INT4_KERNEL_FEATURES = 8  # int4.cpp computes output features in groups of this many
_NO_SCALARS = list[Union[int, float, complex] | None]  # noqa: UP007 - how TorchScript spells Scalar?[]


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    none: _NO_SCALARS = []
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", none, "")


def int4_kernel_linear(x: Tensor, packed: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    """(rows, K), contiguous, through ``int4.cpp``'s ``int4_linear`` (its layout: ``int4_kernel_layout``)."""
    y = torch.ops.trtserver.int4_linear(x, packed, scales)
    return y if bias is None else y + bias


def int4_kernel_gated_linear(gate_up: Tensor, packed: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    """The feed-forward's down projection of ``silu(gate) * up`` for ``gate_up`` (rows, 2K), contiguous, gate
    first, in one ``int4_gated_linear`` call (the product formed as the kernel reads its activations)."""
    y = torch.ops.trtserver.int4_gated_linear(gate_up, packed, scales)
    return y if bias is None else y + bias


def aten_int4_linear(x: Tensor, packed: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    """(rows, K) through ATen's int4 kernel, which takes bfloat16 activations: a float32 model's are rounded
    for it, its output widened."""
    y = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, 32, scales).to(x.dtype)
    return y if bias is None else y + bias


def int8_linear(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """(rows, K) through ``aten._weight_int8pack_mm``."""
    y = torch.ops.aten._weight_int8pack_mm(x, q, scale)
    return y if bias is None else y + bias


def int4_kernel_layout(q: Tensor, scale: Tensor, low: Tensor) -> tuple[Tensor, Tensor]:
    """4-bit weights ``w[n, 32 b + j] = q[n, b, j] * scale[n, b] + low[n, b]`` (q: uint8 (N, K / 32, 32), values
    0-15; N a multiple of 8) in ``int4.cpp``'s layout: output features in groups of 8, a group's block 8 chunks
    of 16 bytes, chunk p's byte j holding for feature j // 2 the value at 2p + j % 2 in its low nibble and at
    16 + 2p + j % 2 in its high one. Returns (packed uint8 (N / 8, K / 32, 128), scales_mins float16
    (N / 8, K / 32, 2, 8): each block's 8 scales, then its 8 mins; a GGUF's 4-bit blocks hold theirs in
    float16 too)."""
    n, blocks, _ = q.shape
    if n % INT4_KERNEL_FEATURES:
        raise ValueError(f"the int4 kernel's layout needs output features in multiples of {INT4_KERNEL_FEATURES}")
    groups = n // INT4_KERNEL_FEATURES
    # (group, feature, block, half, p, e) -> (group, block, half, p, feature, e): k = 16 half + 2 p + e
    chunks = q.view(groups, INT4_KERNEL_FEATURES, blocks, 2, 8, 2).permute(0, 2, 3, 4, 1, 5)
    packed = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(groups, blocks, 128).contiguous()
    per_group = torch.stack([t.float().view(groups, INT4_KERNEL_FEATURES, blocks) for t in (scale, low)], 2)
    return packed, per_group.permute(0, 3, 2, 1).contiguous().to(torch.float16)


def fits_int4_kernel(args: ModelArgs) -> bool:
    """Whether every projection's (and the head's) output features come in ``int4.cpp``'s groups of 8."""
    widths = ((args.n_heads + 2 * args.n_kv_heads) * args.head_dim, args.dim, 2 * args.intermediate_size,
              args.vocab_size)
    return all(width % INT4_KERNEL_FEATURES == 0 for width in widths)


def _as_rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


# ---- CPU: oneDNN's pre-packed weights ------------------------------------------------------------

class PackedLinear(nn.Module):
    """A linear layer whose weight is stored in oneDNN's blocked layout once, at load, instead of
    being repacked by every GEMM call."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = linear.bias
        self.out_features = linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        return packed_linear(x, self.packed, self.bias)


def can_pack_for_cpu(dtype: torch.dtype = torch.float32) -> bool:
    """oneDNN packs float32 on any x86-64 CPU, bfloat16 only where the CPU has AVX-512 (or AVX-NE-CONVERT)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def bf16_rows_invariant() -> bool:
    """Whether this CPU's bfloat16 GEMMs, as the engine runs them (pre-packed where oneDNN packs bfloat16), give a
    row the same bits wherever it sits in a batch: what ``--batch-invariant`` needs of them. On a Zen 4 EPYC
    they do; on a Xeon with AVX-512 FP16 oneDNN's kernels round some rows by their place (float32 pre-packed
    ones do not). A few milliseconds: 32 slices of one feed-forward-sized GEMM against the whole."""
    generator = torch.Generator().manual_seed(0)
    linear = nn.Linear(576, 3072, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(3072, 576, generator=generator))
    gemm: nn.Module = PackedLinear(linear) if can_pack_for_cpu(torch.bfloat16) else linear
    x = torch.randn(64, 576, generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        whole = gemm(x)
        return all(torch.equal(whole[r:r + rows], gemm(x[r:r + rows].contiguous()))
                   for r in range(0, 62, 4) for rows in (1, 3))


def _linear(module: nn.Module) -> nn.Linear:
    if not isinstance(module, nn.Linear):
        raise TypeError(f"expected an nn.Linear to replace, got {type(module).__name__}")
    return module


def pack_for_cpu(model: Transformer) -> None:
    """Swap every nn.Linear (projections and the output head) for a PackedLinear."""
    for layer in cast("list[Block]", model.layers):
        attn, ff = layer.attention, layer.feed_forward
        attn.wqkv, attn.wo = PackedLinear(_linear(attn.wqkv)), PackedLinear(_linear(attn.wo))
        ff.w13, ff.w2 = PackedLinear(_linear(ff.w13)), PackedLinear(_linear(ff.w2))
    model.output = PackedLinear(model.output)  # type: ignore[assignment]


# ---- optional weight-only int4 (CPU) -----------------------------------------------------------

class Int4Linear(nn.Module):
    """Weight-only int4 for small decode batches: groups of 32 along the input dimension, each
    with its own scale and zero (the layout of the GGUF Q4_1 blocks SmolLM2 ships in, so those
    weights come back nearly exactly). Decode is bound by reading weights, and int4 reads a
    quarter of bfloat16's bytes; prefill keeps the model's own weights, and so do decode batches
    above ``SMALL_BATCH`` rows on ATen's int4 kernel, whose time grows with the rows (``int4.cpp``'s
    serves every decode batch).
    """

    GROUP = 32

    def __init__(self, linear: nn.Linear, kernels: KernelSwitch, *, kernel_layout: bool = False) -> None:
        """``kernel_layout``: the weights in the layout of ``int4.cpp``'s ``int4_linear`` (loaded), which
        reads the activations at 16 bits; else in ATen's, whose kernel takes them in bfloat16."""
        super().__init__()
        self.kernels = kernels
        w = linear.weight.detach()
        N, K = w.shape
        g = self.GROUP
        groups = w.float().view(N, K // g, g)
        lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-10)
        q = ((groups - lo) / scale).round().clamp(0, 15).to(torch.int32)  # (N, K / g, g)
        self.kernel_layout = kernel_layout
        if kernel_layout:
            self.packed, self.scales = int4_kernel_layout(q.to(torch.uint8), scale.view(N, K // g), lo.view(N, K // g))
        else:
            self.packed = torch._convert_weight_to_int4pack_for_cpu(q.view(N, K), 1)
            zero = lo + 8 * scale  # the kernel computes (q - 8) * scale + zero
            self.scales = torch.stack([scale.view(N, K // g).t(), zero.view(N, K // g).t()], -1) \
                .contiguous().to(torch.bfloat16)  # (K / g, N, 2)
        self.bias = linear.bias
        self.out_features = N
        self.dense: nn.Module = PackedLinear(linear) if can_pack_for_cpu(linear.weight.dtype) else linear

    def forward(self, x: Tensor) -> Tensor:
        if not self.kernels.small:
            return self.dense.forward(x)
        linear = int4_kernel_linear if self.kernel_layout else aten_int4_linear
        return linear(_as_rows(x), self.packed, self.scales, self.bias).view(*x.shape[:-1], self.out_features)


class Int4Head(Int4Linear):
    """The output head in int4, corrected where it matters: the int4 kernel scores every token, then
    the ``REFINE`` best of each row are scored again with the bfloat16 weights. The head of a Q4 GGUF
    is often kept at 8 bits (SmolLM2's is Q8_0), and 4 bits there changes greedy text; with the
    correction every token that can win or carry real probability has its bfloat16 logit, at the
    cost of one top-k and ``REFINE`` dot products per row (the whole head in bfloat16 would read
    over three times the bytes). The rows' candidates are scored together, their union gathered once."""

    REFINE = 256

    def __init__(self, linear: nn.Linear, kernels: KernelSwitch, *, kernel_layout: bool = False) -> None:
        super().__init__(linear, kernels, kernel_layout=kernel_layout)
        self.weight = linear.weight  # (V, dim); shared with the embedding table when tied

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        if not self.kernels.small:
            return y  # the bfloat16 GEMM already
        rows = x.numel() // x.shape[-1]
        flat, xs = y.view(rows, self.out_features), x.reshape(rows, x.shape[-1])
        if self.kernel_layout and flat.dtype == torch.float32:  # the kernels are loaded: top_k.cpp's selection
            best = torch.ops.trtserver.top_k_indices(flat, self.REFINE)  # (rows, REFINE)
        else:
            best = flat.topk(self.REFINE, dim=-1, sorted=False).indices
        # the rows' best tokens overlap: their union's weight rows are gathered once and scored for every row
        # (index_select, not weight[union]: advanced indexing is the slower gather); one row's are its own
        if rows == 1:
            exact = xs.float() @ self.weight.index_select(0, best[0]).float().t()
        else:
            union, where = torch.unique(best, return_inverse=True)
            exact = (xs.float() @ self.weight.index_select(0, union).float().t()).gather(1, where)
        if self.bias is not None:
            exact += self.bias[best]
        flat.scatter_(1, best, exact.to(flat.dtype))
        return y


class Int8Linear(nn.Module):
    """Weight-only int8, one symmetric scale per output channel (``aten._weight_int8pack_mm``).
    Like int4, only for small decode batches (at 16 rows the pre-packed bfloat16 GEMM is faster)."""

    def __init__(self, linear: nn.Linear, kernels: KernelSwitch) -> None:
        super().__init__()
        self.kernels = kernels
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-10)  # (N,)
        self.q = (w / scale.unsqueeze(1)).round().clamp(-127, 127).to(torch.int8)  # (N, K)
        self.scale = scale.to(linear.weight.dtype)
        self.bias = linear.bias
        self.out_features = self.q.shape[0]
        self.dense: nn.Module = PackedLinear(linear) if can_pack_for_cpu(linear.weight.dtype) else linear

    def forward(self, x: Tensor) -> Tensor:
        if not self.kernels.small:
            return self.dense.forward(x)
        return int8_linear(_as_rows(x), self.q, self.scale, self.bias).view(*x.shape[:-1], self.out_features)


def quantize_weights(model: Transformer, kind: str, *, int4_kernel: bool = False) -> KernelSwitch:
    """Give every projection (and, for int4, the output head) a weight-only int8 / int4 copy for
    decode (CPU, bfloat16 only). int8 leaves the output head in bfloat16: on the head's matrix the
    int8 kernel is no faster than the pre-packed bf16 GEMM. ``int4_kernel``: int4 in the layout of the
    loaded ``int4.cpp`` (``Int4Linear``). Returns the projections' shared switch (``kernel_switch``
    finds it again)."""
    weight = model.tok_embeddings.weight
    dtypes = (torch.bfloat16, torch.float32) if kind == "int4" else (torch.bfloat16,)
    if weight.dtype not in dtypes or weight.device.type != "cpu":
        raise ValueError(f"{kind} weights need dtype {' or '.join(str(d).removeprefix('torch.') for d in dtypes)} "
                         "on the CPU")
    if kind == "int4" and (model.args.dim % Int4Linear.GROUP or model.args.intermediate_size % Int4Linear.GROUP):
        raise ValueError("int4 weights need dimensions divisible by 32")
    k = KernelSwitch()

    def quantized(linear: nn.Module) -> nn.Module:
        if kind == "int4":
            return Int4Linear(_linear(linear), k, kernel_layout=int4_kernel)
        return Int8Linear(_linear(linear), k)

    for layer in cast("list[Block]", model.layers):
        layer.attention.wqkv = quantized(layer.attention.wqkv)
        layer.attention.wo = quantized(layer.attention.wo)
        layer.feed_forward.w13 = quantized(layer.feed_forward.w13)
        layer.feed_forward.w2 = quantized(layer.feed_forward.w2)
    if kind == "int4":
        model.output = Int4Head(model.output, k, kernel_layout=int4_kernel)  # type: ignore[assignment]
    elif can_pack_for_cpu(model.output.weight.dtype):
        model.output = PackedLinear(model.output)  # type: ignore[assignment]
    return k


def kernel_switch(model: Transformer) -> KernelSwitch | None:
    """The switch of ``model``'s quantized projections (under any LoRA wrapping), or None when it has none."""
    first = cast("Block", model.layers[0]).attention.wqkv
    return cast("KernelSwitch | None", getattr(getattr(first, "base", first), "kernels", None))
