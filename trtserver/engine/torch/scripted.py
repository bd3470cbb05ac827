"""The small-batch decode through every layer as one TorchScript function (CPU, quantized weights).

A one-row decode step runs ~40 ATen calls per layer on a few hundred numbers each, and on a 2-core
CPU the Python that issues them cost more than the kernels besides the four projections: a
layer took ~370 µs in eager mode, ~270 µs from TorchScript's interpreter (the same ops on the
same tensors, so the same bits). This module runs exactly the eager small-batch path of
``model.py`` (float32 RMSNorm and SDPA, the int4 / int8 weight-only projections of
``cpu_weights.py``), laid out flat: one list entry per layer and projection.

TorchScript is deprecated in recent torch releases. Where ``torch.jit.script`` is missing or fails,
``build`` returns None and the eager layers run, as they do for LoRA, unquantized and CUDA models.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn

    from trtserver.engine.torch.cpu_weights import Int4Linear, Int8Linear
    from trtserver.engine.torch.model import Block, ForwardContext, Transformer

log = logging.getLogger(__name__)


def _project(x: Tensor, weight: Tensor, scales: Tensor, bias: Tensor | None, int4: bool) -> Tensor:
    if int4:
        y = torch._weight_int4pack_mm_for_cpu(x, weight, 32, scales)
    else:
        y = torch.ops.aten._weight_int8pack_mm(x, weight, scales)
    if bias is not None:
        y = y + bias
    return y


def _norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x.float(), [x.shape[-1]], None, eps).to(x.dtype) * weight


def _decode_layers(x: Tensor, cos: Tensor, sin: Tensor, k_caches: list[Tensor], v_caches: list[Tensor],
                   rows: Tensor, slots: Tensor, slot_start: int, length: int, mask: Tensor | None,
                   norms: list[Tensor], weights: list[Tensor], scales: list[Tensor], biases: list[Tensor | None],
                   int4: bool, eps: float, n_heads: int, n_kv_heads: int, head_dim: int) -> Tensor:
    """``x`` (B, dim) bfloat16, one token per row; ``cos``/``sin`` (B, 1, head_dim). Entry ``4 i + j``
    of the weight lists is layer i's wqkv, wo, w13, w2 (j = 0..3); ``norms[2 i]``, ``norms[2 i + 1]``
    its attention and feed-forward norms. Writes each layer's K and V at ``rows`` of its cache."""
    B = x.shape[0]
    nh, nkv, hs = n_heads, n_kv_heads, head_dim
    for i in range(len(k_caches)):
        k_cache, v_cache = k_caches[i], v_caches[i]
        w = 4 * i
        h = _norm(x, norms[2 * i], eps)
        qkv = _project(h, weights[w], scales[w], biases[w], int4)
        qk, v = qkv.split([(nh + nkv) * hs, nkv * hs], dim=-1)
        qk = qk.view(B, nh + nkv, hs)
        qk = qk * cos + qk.roll(hs // 2, -1) * sin  # model.apply_rope
        q, k = qk.split([nh, nkv], dim=1)
        k_cache.view(-1, hs).index_copy_(0, rows, k.reshape(-1, hs))
        v_cache.view(-1, hs).index_copy_(0, rows, v.reshape(-1, hs))
        if slot_start >= 0:
            keys = k_cache[slot_start:slot_start + B, :, :length]
            values = v_cache[slot_start:slot_start + B, :, :length]
        else:
            keys = k_cache.index_select(0, slots)[:, :, :length]
            values = v_cache.index_select(0, slots)[:, :, :length]
        y = F.scaled_dot_product_attention(q.view(B, nh, 1, hs).float(), keys.float(), values.float(),
                                           attn_mask=mask, enable_gqa=nh != nkv).to(x.dtype)
        x = x + _project(y.view(B, nh * hs), weights[w + 1], scales[w + 1], biases[w + 1], int4)
        h = _norm(x, norms[2 * i + 1], eps)
        gate, up = _project(h, weights[w + 2], scales[w + 2], biases[w + 2], int4).chunk(2, dim=-1)
        x = x + _project(F.silu(gate) * up, weights[w + 3], scales[w + 3], biases[w + 3], int4)
    return x


class ScriptedDecode:
    """What ``Transformer.forward`` calls for a small decode batch instead of its layers."""

    def __init__(self, model: Transformer, fn: Callable[..., Tensor], kind: str) -> None:
        args = model.args
        layers = cast("list[Block]", list(model.layers))
        self._fn = fn
        self._int4 = kind == "int4"
        self._norms = [t for layer in layers for t in (layer.attention_norm.weight, layer.ffn_norm.weight)]
        projections = [p for layer in layers for p in _projections(layer)]
        if self._int4:
            int4 = cast("list[Int4Linear]", projections)
            self._weights = [p.packed for p in int4]
            self._scales = [p.scales_zeros for p in int4]
        else:
            int8 = cast("list[Int8Linear]", projections)
            self._weights = [p.q for p in int8]
            self._scales = [p.scale for p in int8]
        self._biases: list[Tensor | None] = [cast("Tensor | None", getattr(p, "bias", None)) for p in projections]
        self._eps = layers[0].attention_norm.eps
        self._heads = (args.n_heads, args.n_kv_heads, args.head_dim)

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, k_caches: list[Tensor], v_caches: list[Tensor],
                 ctx: ForwardContext) -> Tensor:
        """``x`` (B, 1, dim) and ``cos``/``sin`` (B, 1, 1, head_dim), as the eager layers take them."""
        B, _, dim = x.shape
        mask = ctx.additive_mask()
        slot_start = -1 if ctx.slot_start is None else ctx.slot_start
        # unoptimized: the profiling executor's first call took ~50 ms and new batch shapes re-profiled,
        # for graphs it cannot fuse on the CPU anyway (steady steps: 8.9-9.1 ms either way)
        with torch.jit.optimized_execution(False):
            y = self._fn(x.view(B, dim), cos.view(B, 1, -1), sin.view(B, 1, -1), k_caches, v_caches,
                         ctx.cache_rows(k_caches[0]), ctx.slots, slot_start, ctx.length, mask, self._norms,
                         self._weights, self._scales, self._biases, self._int4, self._eps, *self._heads)
        return y.view(B, 1, dim)


def _projections(layer: Block) -> tuple[nn.Module, ...]:
    return (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13, layer.feed_forward.w2)


def build(model: Transformer) -> ScriptedDecode | None:
    """The scripted small-batch decode for ``model``, or None where it does not apply: projections
    that are not all int4 or all int8 (unquantized, LoRA-wrapped), or no working TorchScript."""
    from trtserver.engine.torch.cpu_weights import Int4Linear, Int8Linear

    kinds = {type(p) for layer in cast("list[Block]", list(model.layers)) for p in _projections(layer)}
    if kinds == {Int4Linear}:
        kind = "int4"
    elif kinds == {Int8Linear}:
        kind = "int8"
    else:
        return None
    script = getattr(torch.jit, "script", None)
    if script is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # deprecated, not gone: see the module's text
            fn = script(_decode_layers)
    except Exception:  # noqa: BLE001 - any TorchScript failure leaves the eager layers in charge
        log.warning("TorchScript could not compile the small-batch decode; the eager layers run it", exc_info=True)
        return None
    return ScriptedDecode(model, fn, kind)
