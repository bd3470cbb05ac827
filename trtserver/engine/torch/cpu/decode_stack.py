"""Every decoder block of a decode step as one call to ``decode_stack.cpp``'s ``int4_decode_layers`` (CPU): the
path of ``decode_layers.DecodeLayers`` with ``int4.cpp``'s int4 projections and every fused kernel, on a float32
model without projection biases. Its pieces are that path's own C++ functions, in the same order on the same
numbers, so its bits are the scripted path's; what it saves is the issuing: an op dispatch, a new tensor and
interpreter work for each of the nine pieces of each layer (figures in docs/perf-decisions.md).
``scripted.py`` takes it for that path where ``fits`` says so, and the scripted layers elsewhere."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from trtserver.engine.torch.cpu.weights import Int4Linear

if TYPE_CHECKING:
    from trtserver.engine.torch.cpu.decode_layers import DecodeStep
    from trtserver.engine.torch.model import Block, Transformer


class Int4DecodeStack:
    """Called as the scripted layers are: ``(x, cos, sin, k_caches, v_caches, step)``, ``x`` (B, dim) and
    ``cos``/``sin`` (B, head_dim); returns the residual stream out of the last block."""

    def __init__(self, model: Transformer, projections: list[tuple[nn.Module, ...]]) -> None:
        """``projections``: each layer's wqkv, wo, w13 and w2, bare (see ``fits``)."""
        layers = cast("list[Block]", list(model.layers))
        self.norms = [norm.weight for layer in layers for norm in (layer.attention_norm, layer.ffn_norm)]
        int4 = [cast("Int4Linear", p) for layer in projections for p in layer]
        self.packed, self.scales = [p.packed for p in int4], [p.scales for p in int4]
        self.eps = layers[0].attention_norm.eps
        self.n_heads, self.n_kv_heads = model.args.n_heads, model.args.n_kv_heads

    @staticmethod
    def fits(model: Transformer, projections: list[tuple[nn.Module, ...]]) -> bool:
        """Whether the op computes ``model``'s decode: float32, every projection int4 in the kernel's layout
        and without a bias, one norm epsilon throughout."""
        layers = cast("list[Block]", list(model.layers))
        return (model.tok_embeddings.weight.dtype == torch.float32
                and all(isinstance(p, Int4Linear) and p.kernel_layout and p.bias is None
                        for layer in projections for p in layer)
                and len({norm.eps for layer in layers for norm in (layer.attention_norm, layer.ffn_norm)}) == 1)

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, k_caches: list[Tensor], v_caches: list[Tensor],
                 step: DecodeStep) -> Tensor:
        return cast("Tensor", torch.ops.trtserver.int4_decode_layers(
            x, cos, sin, k_caches, v_caches, step.slots, step.positions, self.norms, self.packed, self.scales,
            self.n_heads, self.n_kv_heads, self.eps))
