"""The CPU's decode attention (``ForwardContext.attend``): float32 SDPA for small batches, and the bmm
on K/V copied into a dense buffer first (bfloat16). The raw functions are the scripted decode's too."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn.functional as F
from torch import Tensor

from trtserver.engine.torch.attention import decode_attention

if TYPE_CHECKING:
    from trtserver.engine.torch.model import ForwardContext


def small_attention(q: Tensor, keys: Tensor, values: Tensor, ctx: ForwardContext) -> Tensor:
    B, _, nh, hs = q.shape
    return small_decode_attention(q.transpose(1, 2), keys, values, ctx.additive_mask()).view(B, 1, nh * hs)


def dense_attention(q: Tensor, keys: Tensor, values: Tensor, ctx: ForwardContext) -> Tensor:
    """``decode_attention``, on a copy of the live K/V in ``ctx.dense`` where the cache is read through a view."""
    if ctx.slot_start is not None and ctx.dense is not None:
        keys, values = into_buffer(keys, ctx.dense[0]), into_buffer(values, ctx.dense[1])
    return decode_attention(q, keys, values, ctx)


def small_decode_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """A few rows' decode attention in float32 SDPA, which beats bfloat16 matmuls there (at 16 rows the
    bmm wins: the conversion reads K/V once more). ``q`` (B, nh, 1, hs)
    against (B, nkv, L, hs); ``mask`` additive (``ForwardContext.additive_mask``); returns q's dtype."""
    return F.scaled_dot_product_attention(q.float(), keys.float(), values.float(), attn_mask=mask,
                                          enable_gqa=q.shape[1] != keys.shape[1]).to(q.dtype)


def into_buffer(t: Tensor, buffer: Tensor) -> Tensor:
    """``t`` copied into the front of a flat, reused buffer: oneDNN's bf16 bmm on the cache's strided
    view is slower than this copy plus the dense bmm (same results)."""
    return buffer[:t.numel()].view(t.shape).copy_(t)
