"""Decode attention for one query row per sequence, a ``ForwardContext.attend`` the model runner gives decode
steps (the model's own, for prefill, is SDPA: ``model.sdpa_attention``). Each takes q (B, T, nh, hs) and
the live K/V (B, nkv, L, hs) and returns (B, T, nh * hs). The CPU's variants are in ``cpu/attention.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from trtserver.engine.torch.model import ForwardContext


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, ctx: ForwardContext) -> Tensor:
    B, _, nh, hs = q.shape
    return bmm_decode_attention(q, keys, values, ctx.mask).view(B, 1, nh * hs)


def bmm_decode_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """Decode attention as two small matmuls, which beat the flash kernel for one query row: ``q`` any
    shape holding (B, nh, hs), q head j*g + i reading kv head j, against (B, nkv, L, hs); ``mask`` boolean
    (B, 1, 1, L), True = attend. Scores and softmax in float32; returns (B, nkv, g, hs)."""
    B, nkv, _, hs = keys.shape
    scores = (q.reshape(B, nkv, -1, hs) @ keys.transpose(-1, -2)).float() * (hs ** -0.5)  # (B, nkv, g, L)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return scores.softmax(dim=-1).to(values.dtype) @ values
