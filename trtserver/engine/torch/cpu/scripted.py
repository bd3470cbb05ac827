"""Decode steps through every layer as one TorchScript function (CPU).

A decode step runs ~40 ATen calls per layer on small tensors, and the Python that issues them is a
large share of a CPU step. TorchScript's interpreter issues the same calls on the same tensors, so
the results are the same bits, for less (figures in docs/perf-decisions.md).

Two functions, one per eager decode path of ``model.py``:
- ``_small_decode``: batches of up to ``model_runner.SMALL_BATCH`` rows with int4 / int8 weight-only projections
  (``weights.py``), float32 RMSNorm and SDPA;
- ``_batch_decode``: larger batches, and every decode of a model without the small-batch kernels
  (float32, unquantized), through oneDNN's pre-packed projections and the bmm attention (the K/V
  copied into the dense buffers first, for bfloat16).
Where the fused kernels of ``kernels.cpp`` load, ``_fused_decode`` and ``_fused_batch_decode``
take their place: RMSNorm, RoPE with the K/V write and (small batches) the attention in one call each,
a dozen calls per layer instead of ~40. Their reductions sum in their own order, so they are close
to the eager layers, not bit for bit.

Prefill stays eager (its GEMMs dwarf the calls), and so do CUDA (it has its graphs) and, on a LoRA
server, the batches with an adapter (the model runner sends those to the eager layers; its base batches
take the ATen-call functions on the bare projections). TorchScript is deprecated in recent torch releases: where
``torch.jit.script`` is missing or fails, the eager layers run.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Union, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from trtserver.engine.torch.attention import bmm_decode_attention
from trtserver.engine.torch.cpu.attention import into_buffer, small_decode_attention
from trtserver.engine.torch.model import apply_rope, rms_norm

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn

    from trtserver.engine.torch.cache import KVCache
    from trtserver.engine.torch.model import Block, ForwardContext, Transformer

log = logging.getLogger(__name__)

_NO_SCALARS = list[Union[int, float, complex] | None]  # noqa: UP007 - how TorchScript spells Scalar?[]


def _quantized(x: Tensor, weight: Tensor, scales: Tensor, bias: Tensor | None, int4: bool) -> Tensor:
    if int4:  # bfloat16 activations; a float32 model's are rounded for the kernel (no-ops in bfloat16)
        y = torch._weight_int4pack_mm_for_cpu(x.to(scales.dtype), weight, 32, scales).to(x.dtype)
    else:
        y = torch.ops.aten._weight_int8pack_mm(x, weight, scales)
    if bias is not None:
        y = y + bias
    return y


def _fused_quantized(x: Tensor, weight: Tensor, scales: Tensor, bias: Tensor | None, int4: bool,
                     int4_kernel: bool) -> Tensor:
    """``_quantized``, or where the int4 weights are in ``int4.cpp``'s layout its ``int4_linear``."""
    if not int4_kernel:
        return _quantized(x, weight, scales, bias, int4)
    y = torch.ops.trtserver.int4_linear(x, weight, scales)
    return y if bias is None else y + bias


def _packed(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    none: _NO_SCALARS = []
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", none, "")


def _rope_and_cache(qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, rows: Tensor,
                    n_heads: int, n_kv_heads: int, head_dim: int) -> Tensor:
    """Rotates q and k, writes k and v at ``rows`` of the caches; returns q (B, nh, hs)."""
    B = qkv.shape[0]
    nh, nkv, hs = n_heads, n_kv_heads, head_dim
    qk, v = qkv.split([(nh + nkv) * hs, nkv * hs], dim=-1)
    q, k = apply_rope(qk.view(B, nh + nkv, hs), cos, sin).split([nh, nkv], dim=1)
    k_cache.view(-1, hs).index_copy_(0, rows, k.reshape(-1, hs))
    v_cache.view(-1, hs).index_copy_(0, rows, v.reshape(-1, hs))
    return q


def _live(cache: Tensor, slots: Tensor, slot_start: int, rows: int, length: int) -> Tensor:
    """The batch's slots, first ``length`` positions: a view where the slots are consecutive."""
    if slot_start >= 0:
        return cache[slot_start:slot_start + rows, :, :length]
    return cache[:, :, :length].index_select(0, slots)  # sliced first: gather the live positions only


def _small_decode(x: Tensor, cos: Tensor, sin: Tensor, k_caches: list[Tensor], v_caches: list[Tensor],
                  rows: Tensor, slots: Tensor, slot_start: int, length: int, mask: Tensor | None,
                  norms: list[Tensor], weights: list[Tensor], scales: list[Tensor], biases: list[Tensor | None],
                  int4: bool, eps: float, n_heads: int, n_kv_heads: int, head_dim: int) -> Tensor:
    """``x`` (B, dim), one token per row; ``cos``/``sin`` (B, 1, head_dim); ``mask`` additive float32.
    Entry ``4 i + j`` of the weight lists is layer i's wqkv, wo, w13, w2 (j = 0..3); ``norms[2 i]``,
    ``norms[2 i + 1]`` its attention and feed-forward norms."""
    B = x.shape[0]
    nh, nkv, hs = n_heads, n_kv_heads, head_dim
    for i in range(len(k_caches)):
        w = 4 * i
        qkv = _quantized(rms_norm(x, norms[2 * i], eps), weights[w], scales[w], biases[w], int4)
        q = _rope_and_cache(qkv, cos, sin, k_caches[i], v_caches[i], rows, nh, nkv, hs)
        keys = _live(k_caches[i], slots, slot_start, B, length)
        values = _live(v_caches[i], slots, slot_start, B, length)
        y = small_decode_attention(q.view(B, nh, 1, hs), keys, values, mask)
        x = x + _quantized(y.view(B, nh * hs), weights[w + 1], scales[w + 1], biases[w + 1], int4)
        gate, up = _quantized(rms_norm(x, norms[2 * i + 1], eps), weights[w + 2], scales[w + 2], biases[w + 2],
                              int4).chunk(2, dim=-1)
        x = x + _quantized(F.silu(gate) * up, weights[w + 3], scales[w + 3], biases[w + 3], int4)
    return x


def _fused_decode(x: Tensor, cos: Tensor, sin: Tensor, k_caches: list[Tensor], v_caches: list[Tensor],
                  slots: Tensor, positions: Tensor, norms: list[Tensor], weights: list[Tensor], scales: list[Tensor],
                  biases: list[Tensor | None], int4: bool, int4_kernel: bool, eps: float, n_heads: int,
                  n_kv_heads: int) -> Tensor:
    """``_small_decode`` with the fused kernels of ``kernels.cpp``: ``cos``/``sin`` (B, head_dim),
    each row's K/V slot and position instead of the cache rows, the length and the mask; ``int4_kernel``: the
    int4 weights are in the kernels' own layout."""
    for i in range(len(k_caches)):
        w = 4 * i
        qkv = _fused_quantized(torch.ops.trtserver.rms_norm(x, norms[2 * i], eps), weights[w], scales[w], biases[w],
                               int4, int4_kernel)
        q = torch.ops.trtserver.rope_cache(qkv, cos, sin, k_caches[i], v_caches[i], slots, positions, n_heads,
                                           n_kv_heads)
        y = torch.ops.trtserver.decode_attention(q, k_caches[i], v_caches[i], slots, positions)
        x = x + _fused_quantized(y, weights[w + 1], scales[w + 1], biases[w + 1], int4, int4_kernel)
        gate, up = _fused_quantized(torch.ops.trtserver.rms_norm(x, norms[2 * i + 1], eps), weights[w + 2],
                                    scales[w + 2], biases[w + 2], int4, int4_kernel).chunk(2, dim=-1)
        # SiLU × up stays ATen's, whose exp is vectorised
        x = x + _fused_quantized(F.silu(gate) * up, weights[w + 3], scales[w + 3], biases[w + 3], int4, int4_kernel)
    return x


def _fused_batch_decode(x: Tensor, cos: Tensor, sin: Tensor, k_caches: list[Tensor], v_caches: list[Tensor],
                        slots: Tensor, positions: Tensor, slot_start: int, length: int, mask: Tensor | None,
                        dense_k: Tensor | None, dense_v: Tensor | None, norms: list[Tensor], weights: list[Tensor],
                        biases: list[Tensor | None], eps: float, n_heads: int, n_kv_heads: int) -> Tensor:
    """``_batch_decode`` with the fused RMSNorm and RoPE / K/V write; ``cos``/``sin`` (B, head_dim).
    Attention stays the bmm: at 16 rows oneDNN's batched GEMMs beat the kernel's loops."""
    nh, nkv = n_heads, n_kv_heads
    for i in range(len(k_caches)):
        w = 4 * i
        qkv = _packed(torch.ops.trtserver.rms_norm(x, norms[2 * i], eps), weights[w], biases[w])
        q = torch.ops.trtserver.rope_cache(qkv, cos, sin, k_caches[i], v_caches[i], slots, positions, nh, nkv)
        y = _bmm_attention(q, k_caches[i], v_caches[i], slots, slot_start, length, mask, dense_k, dense_v)
        x = x + _packed(y, weights[w + 1], biases[w + 1])
        gate, up = _packed(torch.ops.trtserver.rms_norm(x, norms[2 * i + 1], eps), weights[w + 2],
                           biases[w + 2]).chunk(2, dim=-1)
        x = x + _packed(F.silu(gate) * up, weights[w + 3], biases[w + 3])
    return x


def _bmm_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, slot_start: int, length: int,
                   mask: Tensor | None, dense_k: Tensor | None, dense_v: Tensor | None) -> Tensor:
    """The eager batch path's decode attention on the live K/V (copied into the dense buffers first, where
    given and the slots are consecutive); returns (B, nh * hs)."""
    B, nh, hs = q.shape
    keys = _live(k_cache, slots, slot_start, B, length)
    values = _live(v_cache, slots, slot_start, B, length)
    if slot_start >= 0 and dense_k is not None and dense_v is not None:
        keys, values = into_buffer(keys, dense_k), into_buffer(values, dense_v)
    return bmm_decode_attention(q, keys, values, mask).reshape(B, nh * hs)


def _batch_decode(x: Tensor, cos: Tensor, sin: Tensor, k_caches: list[Tensor], v_caches: list[Tensor],
                  rows: Tensor, slots: Tensor, slot_start: int, length: int, mask: Tensor | None,
                  dense_k: Tensor | None, dense_v: Tensor | None, norms: list[Tensor], weights: list[Tensor],
                  biases: list[Tensor | None], eps: float, n_heads: int, n_kv_heads: int, head_dim: int) -> Tensor:
    """As ``_small_decode``, with pre-packed weights; ``mask`` boolean (B, 1, 1, length), True = attend;
    ``dense_k``/``dense_v`` the flat buffers the live K/V are copied into (bfloat16), or None."""
    nh, nkv, hs = n_heads, n_kv_heads, head_dim
    for i in range(len(k_caches)):
        w = 4 * i
        qkv = _packed(rms_norm(x, norms[2 * i], eps), weights[w], biases[w])
        q = _rope_and_cache(qkv, cos, sin, k_caches[i], v_caches[i], rows, nh, nkv, hs)
        y = _bmm_attention(q, k_caches[i], v_caches[i], slots, slot_start, length, mask, dense_k, dense_v)
        x = x + _packed(y, weights[w + 1], biases[w + 1])
        gate, up = _packed(rms_norm(x, norms[2 * i + 1], eps), weights[w + 2], biases[w + 2]).chunk(2, dim=-1)
        x = x + _packed(F.silu(gate) * up, weights[w + 3], biases[w + 3])
    return x


class ScriptedDecode:
    """A decode step of ``model`` (embedding to final norm) through its layers as one TorchScript call,
    where it ``covers`` the step's path (small batch or not); the model runner calls it instead of the model
    for batches without adapters."""

    def __init__(self, model: Transformer, small: Callable[..., Tensor] | None, batch: Callable[..., Tensor] | None,
                 *, int4: bool, int4_kernel: bool, fused: tuple[bool, bool]) -> None:
        args = model.args
        layers = _blocks(model)
        projections = [p for layer in layers for p in _projections(layer)]
        self.model = model
        self._small, self._batch, self._int4, self._int4_kernel = small, batch, int4, int4_kernel
        self.fused_small, self.fused_batch = fused  # which paths run the fused kernels (_fused_*decode)
        self._norms = [t for layer in layers for t in (layer.attention_norm.weight, layer.ffn_norm.weight)]
        self._biases = [cast("Tensor | None", getattr(p, "bias", None)) for p in projections]
        # small: the quantized weights and their scales; batch: the pre-packed ones (a quantized
        # projection keeps its packed copy as ``dense``)
        quantized = [(p.packed, p.scales) if int4 else (p.q, p.scale) for p in projections] \
            if small is not None else []
        self._quantized = [w for w, _ in quantized]
        self._scales = [s for _, s in quantized]
        self._packed = [getattr(p, "dense", p).packed for p in projections] if batch is not None else []
        self._eps: float = layers[0].attention_norm.eps
        self._heads = (args.n_heads, args.n_kv_heads, args.head_dim)

    def covers(self, small: bool) -> bool:
        return (self._small if small else self._batch) is not None

    def __call__(self, tokens: Tensor, ctx: ForwardContext, cache: KVCache) -> Tensor:
        """``model(tokens, ctx, cache)`` for a decode step: ``tokens`` (B, 1); hidden states (B, 1, dim).
        It runs the bare projections: never a batch with adapters."""
        model = self.model
        x = model.tok_embeddings(tokens)  # (B, 1, dim)
        cos, sin = model.rope(ctx.pos)  # (B, 1, 1, head_dim)
        return model.norm(self._layers(x, cos, sin, cache.k, cache.v, ctx))

    def _layers(self, x: Tensor, cos: Tensor, sin: Tensor, k_caches: list[Tensor], v_caches: list[Tensor],
                ctx: ForwardContext) -> Tensor:
        B, _, dim = x.shape
        x2, slot_start = x.view(B, dim), -1 if ctx.slot_start is None else ctx.slot_start
        # unoptimized: the profiling executor re-profiles every new batch shape, for graphs it cannot
        # fuse on the CPU anyway
        with torch.jit.optimized_execution(False):
            if ctx.small and self.fused_small:
                assert self._small is not None
                y = self._small(x2, cos.view(B, -1), sin.view(B, -1), k_caches, v_caches, ctx.slots, ctx.pos.view(-1),
                                self._norms, self._quantized, self._scales, self._biases, self._int4,
                                self._int4_kernel, self._eps, *self._heads[:2])
            elif not ctx.small and self.fused_batch:
                assert self._batch is not None
                dense_k, dense_v = ctx.dense if ctx.dense is not None else (None, None)
                y = self._batch(x2, cos.view(B, -1), sin.view(B, -1), k_caches, v_caches, ctx.slots, ctx.pos.view(-1),
                                slot_start, ctx.length, ctx.mask, dense_k, dense_v, self._norms, self._packed,
                                self._biases, self._eps, *self._heads[:2])
            elif ctx.small:  # the ATen calls: K/V written at the flat cache rows, rope tables (B, 1, head_dim)
                assert self._small is not None
                y = self._small(x2, cos.view(B, 1, -1), sin.view(B, 1, -1), k_caches, v_caches,
                                ctx.cache_rows(k_caches[0]), ctx.slots, slot_start, ctx.length, ctx.additive_mask(),
                                self._norms, self._quantized, self._scales, self._biases, self._int4, self._eps,
                                *self._heads)
            else:
                assert self._batch is not None
                dense_k, dense_v = ctx.dense if ctx.dense is not None else (None, None)
                y = self._batch(x2, cos.view(B, 1, -1), sin.view(B, 1, -1), k_caches, v_caches,
                                ctx.cache_rows(k_caches[0]), ctx.slots, slot_start, ctx.length, ctx.mask, dense_k,
                                dense_v, self._norms, self._packed, self._biases, self._eps, *self._heads)
        return y.view(B, 1, dim)


def _blocks(model: Transformer) -> list[Block]:
    return cast("list[Block]", list(model.layers))


def _raw_projections(layer: Block) -> tuple[nn.Module, ...]:
    return (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13, layer.feed_forward.w2)


def _projections(layer: Block) -> tuple[nn.Module, ...]:
    """The layer's projections, under any LoRA wrapping (``lora.LoraLinear.base``)."""
    from trtserver.engine.torch.lora import LoraLinear

    return tuple(p.base if isinstance(p, LoraLinear) else p for p in _raw_projections(layer))


def _has_lora(model: Transformer) -> bool:
    """Whether ``model``'s projections are wrapped for LoRA adapters (a LoRA server)."""
    from trtserver.engine.torch.lora import LoraLinear

    return any(isinstance(p, LoraLinear) for layer in _blocks(model) for p in _raw_projections(layer))


def _script(fn: Callable[..., Tensor]) -> Callable[..., Tensor] | None:
    script = getattr(torch.jit, "script", None)
    if script is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # deprecated, not gone: see the module's text
            return cast("Callable[..., Tensor]", script(fn))
    except Exception:  # noqa: BLE001 - any TorchScript failure leaves the eager layers in charge
        log.warning("TorchScript could not compile %s; the eager layers run it", fn.__name__, exc_info=True)
        return None


def build(model: Transformer, *, fused: bool = True) -> ScriptedDecode | None:
    """The scripted decode for ``model`` (CPU), or None where neither path fits: the small-batch one
    needs every projection int4, or every one int8; the batch one every projection pre-packed
    (``PackedLinear``, or quantized with a packed copy). On a LoRA server it serves the batches with no
    adapter, through the same ATen calls as the eager layers and never the fused kernels: a row's bits
    then do not depend on whether another row of its batch has an adapter."""
    from trtserver.engine.torch.cpu.weights import Int4Linear, Int8Linear, PackedLinear

    if _has_lora(model):
        fused = False

    projections = [p for layer in _blocks(model) for p in _projections(layer)]
    kinds = {type(p) for p in projections}
    int4 = kinds == {Int4Linear}
    quantized = int4 or kinds == {Int8Linear}
    packed = all(isinstance(getattr(p, "dense", p), PackedLinear) for p in projections) \
        and kinds <= {PackedLinear, Int4Linear, Int8Linear}
    # the kernels were loaded when the weights took their layout
    int4_kernel = int4 and all(getattr(p, "kernel_layout", False) for p in projections)
    dtype = model.tok_embeddings.weight.dtype
    fuse_small = quantized and dtype in (torch.bfloat16, torch.float32)
    # float32 batches keep the ATen calls: the fused RMSNorm and RoPE bring them nothing measurable
    fuse_batch = packed and dtype == torch.bfloat16
    if fused and (fuse_small or fuse_batch):
        from trtserver.engine.torch.cpu import kernels

        fused = kernels.load()
    else:
        fused = False
    small = _script(_fused_decode) if fused and fuse_small else None
    fused_small = small is not None
    if quantized and small is None and not int4_kernel:  # the ATen calls cannot read the kernels' int4 layout
        small = _script(_small_decode)
    batch = _script(_fused_batch_decode) if fused and fuse_batch else None
    fused_batch = batch is not None
    if packed and batch is None:
        batch = _script(_batch_decode)
    if small is None and batch is None:
        return None
    return ScriptedDecode(model, small, batch, int4=int4, int4_kernel=int4_kernel, fused=(fused_small, fused_batch))
