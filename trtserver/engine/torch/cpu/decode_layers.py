"""The decoder blocks of a decode step as one TorchScript module (CPU); ``scripted.py`` builds and calls it.

``DecodeLayers`` is the model's ``Block`` for a decode step, written once, with a path's pieces chosen by
module constants (``PathKind``), so TorchScript compiles only the branches the path takes:

- the projections through ``weights.py``'s functions, the very ones its eager modules call: int4 / int8 for
  small batches (up to ``model_runner.SMALL_BATCH`` rows; every decode batch on ``int4.cpp``'s int4), oneDNN's
  pre-packed weights for larger ones and for every decode of an unquantized model;
- the attention: float32 SDPA for small batches, the bmm for larger ones (on the K/V copied into the dense
  buffers first, for bfloat16);
- where the fused kernels of ``kernels.cpp`` load, RMSNorm, RoPE with the K/V write and (small batches)
  the attention are one call each, and on ``int4.cpp``'s int4 the feed-forward's SiLU × up is formed inside
  its down projection. Their reductions sum in their own order, so they are close to the eager
  layers, not bit for bit; without them the calls are the eager layers' own, and so are the bits.

A change to the model's layer (``model.py``) is a change here too, where a model family needs it.
This file has no postponed annotations: TorchScript reads a NamedTuple's fields and a module's attribute
types from the annotations' values.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trtserver.engine.torch.attention import bmm_decode_attention
from trtserver.engine.torch.cpu.attention import into_buffer, small_decode_attention
from trtserver.engine.torch.cpu.weights import (
    Int4Linear,
    Int8Linear,
    PackedLinear,
    aten_int4_linear,
    int4_kernel_gated_linear,
    int4_kernel_linear,
    int8_linear,
    packed_linear,
)
from trtserver.engine.torch.model import apply_rope, rms_norm

if TYPE_CHECKING:
    from trtserver.engine.torch.model import Block, Transformer


class DecodeStep(NamedTuple):
    """Where a decode step's rows read and write the cache, in the forms the layers take."""

    slots: Tensor  # (B,) each row's KV slot
    positions: Tensor  # (B,) each row's position
    rows: Tensor | None  # (B * nkv,) the rows of the caches seen as (-1, head_dim), for the ATen-call write
    slot_start: int  # the first slot where the slots are consecutive, else -1
    length: int  # keys to attend over
    mask: Tensor | None  # additive float32 for SDPA, boolean for the bmm, None for the fused kernel
    dense_k: Tensor | None  # the flat buffers the live K/V are copied into (bfloat16), or None
    dense_v: Tensor | None


@dataclass(frozen=True, slots=True)
class PathKind:
    """How one path's layers compute: ``projection`` "packed", "int4_kernel", "aten_int4" or "int8" (the
    functions of ``weights.py``); ``attention`` "kernel" (fused), "sdpa" (float32, small batches) or "bmm";
    ``fused``: RMSNorm and the RoPE / K/V write through the fused kernels."""

    projection: str
    attention: str
    fused: bool


class DecodeLayers(nn.Module):
    """Every decoder block of a decode step on ``x`` (B, dim): the model's ``Block`` with the path's
    projections, norm, K/V write and attention. Which ones are module constants, so TorchScript compiles
    only the branches its path takes."""

    __constants__ = ["fused", "int4_kernel", "aten_int4", "int8", "kernel_attention", "sdpa", "eps", "n_heads",
                     "n_kv_heads", "head_dim"]
    projections: list[list[tuple[Tensor, Tensor, Tensor | None]]]  # typed here: a model without biases has only None

    def __init__(self, model: "Transformer", projections: list[tuple[nn.Module, ...]], kind: PathKind) -> None:
        """``projections``: each layer's wqkv, wo, w13 and w2, bare (under any LoRA wrapping)."""
        super().__init__()
        args, layers = model.args, cast("list[Block]", list(model.layers))
        self.fused = kind.fused
        self.int4_kernel, self.aten_int4, self.int8 = (kind.projection == k for k in ("int4_kernel", "aten_int4",
                                                                                        "int8"))
        self.kernel_attention, self.sdpa = kind.attention == "kernel", kind.attention == "sdpa"
        self.eps: float = layers[0].attention_norm.eps
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        # per layer: its two norms' weights, and each projection's tensors (wqkv, wo, w13, w2)
        self.norms = [(layer.attention_norm.weight, layer.ffn_norm.weight) for layer in layers]
        self.projections = [[_tensors(p, kind.projection) for p in layer] for layer in projections]

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, k_caches: list[Tensor], v_caches: list[Tensor],
                step: DecodeStep) -> Tensor:
        for i in range(len(self.projections)):
            x = self._block(x, cos, sin, k_caches[i], v_caches[i], step, self.norms[i], self.projections[i])
        return x

    def _block(self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, step: DecodeStep,
               norms: tuple[Tensor, Tensor], p: list[tuple[Tensor, Tensor, Tensor | None]]) -> Tensor:
        q = self._write(self._project(self._norm(x, norms[0]), p[0]), cos, sin, k_cache, v_cache, step)
        h = x + self._project(self._attend(q, k_cache, v_cache, step), p[1])
        gate_up = self._project(self._norm(h, norms[1]), p[2])
        if self.int4_kernel and self.fused:
            weight, scales, bias = p[3]
            return h + int4_kernel_gated_linear(gate_up, weight, scales, bias)
        gate, up = gate_up.chunk(2, dim=-1)
        return h + self._project(F.silu(gate) * up, p[3])

    def _norm(self, x: Tensor, weight: Tensor) -> Tensor:
        if self.fused:
            return torch.ops.trtserver.rms_norm(x, weight, self.eps)
        return rms_norm(x, weight, self.eps)

    def _project(self, x: Tensor, projection: tuple[Tensor, Tensor, Tensor | None]) -> Tensor:
        weight, scales, bias = projection
        if self.int4_kernel:
            return int4_kernel_linear(x, weight, scales, bias)
        if self.aten_int4:
            return aten_int4_linear(x, weight, scales, bias)
        if self.int8:
            return int8_linear(x, weight, scales, bias)
        return packed_linear(x, weight, bias)

    def _write(self, qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
               step: DecodeStep) -> Tensor:
        """Rotates q and k, writes k and v to the cache; returns q (B, nh, hs). ``cos``/``sin`` (B, head_dim)
        for the fused kernel, else (B, 1, head_dim) for the model's ``apply_rope``."""
        nh, nkv, hs = self.n_heads, self.n_kv_heads, self.head_dim
        if self.fused:
            return torch.ops.trtserver.rope_cache(qkv, cos, sin, k_cache, v_cache, step.slots, step.positions, nh, nkv)
        rows = step.rows
        assert rows is not None
        B = qkv.shape[0]
        qk, v = qkv.split([(nh + nkv) * hs, nkv * hs], dim=-1)
        q, k = apply_rope(qk.view(B, nh + nkv, hs), cos, sin).split([nh, nkv], dim=1)
        k_cache.view(-1, hs).index_copy_(0, rows, k.reshape(-1, hs))
        v_cache.view(-1, hs).index_copy_(0, rows, v.reshape(-1, hs))
        return q

    def _attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, step: DecodeStep) -> Tensor:
        """q (B, nh, hs) against the cache; (B, nh * hs). The fused kernel reads each row's slot up to its
        position; SDPA (float32, small batches) and the bmm read the live K/V, the bmm from the dense
        buffers where given and the slots are consecutive (at 16 rows oneDNN's batched GEMMs beat the
        kernel's loops)."""
        if self.kernel_attention:
            return torch.ops.trtserver.decode_attention(q, k_cache, v_cache, step.slots, step.positions)
        B, nh, hs = q.shape
        keys = _live(k_cache, step.slots, step.slot_start, B, step.length)
        values = _live(v_cache, step.slots, step.slot_start, B, step.length)
        if self.sdpa:
            return small_decode_attention(q.view(B, nh, 1, hs), keys, values, step.mask).view(B, nh * hs)
        dense_k, dense_v = step.dense_k, step.dense_v
        if step.slot_start >= 0 and dense_k is not None and dense_v is not None:
            keys, values = into_buffer(keys, dense_k), into_buffer(values, dense_v)
        return bmm_decode_attention(q, keys, values, step.mask).reshape(B, nh * hs)


def _tensors(projection: nn.Module, kind: str) -> tuple[Tensor, Tensor, Tensor | None]:
    """A projection's weights for ``kind``'s function (scales empty where it takes none), and its bias."""
    if kind == "packed":
        packed = projection.dense if isinstance(projection, Int4Linear | Int8Linear) else projection
        assert isinstance(packed, PackedLinear)
        return packed.packed, torch.empty(0), packed.bias
    if isinstance(projection, Int8Linear):
        return projection.q, projection.scale, projection.bias
    assert isinstance(projection, Int4Linear)
    return projection.packed, projection.scales, projection.bias


def _live(cache: Tensor, slots: Tensor, slot_start: int, rows: int, length: int) -> Tensor:
    """The batch's slots, first ``length`` positions: a view where the slots are consecutive."""
    if slot_start >= 0:
        return cache[slot_start:slot_start + rows, :, :length]
    return cache[:, :, :length].index_select(0, slots)  # sliced first: gather the live positions only
