"""Decode steps through every layer as one TorchScript call (CPU): which paths can be scripted for a model
as its weights now are, and the call that stands in for the model's forward.

A decode step runs a dozen to ~40 ATen calls per layer on small tensors, and the Python that issues them
is a large share of a CPU step. TorchScript's interpreter issues the same calls on the same tensors, for
less (figures in docs/perf-decisions.md). The layers it runs are ``decode_layers.DecodeLayers``; on a float32
model's ``int4.cpp`` int4 the step is one C++ call instead (``decode_stack.py``), the same pieces bit for bit.

Prefill stays eager (its GEMMs dwarf the calls), and so do CUDA (it has its graphs) and, on a LoRA
server, the batches with an adapter (the model runner sends those to the eager layers; its base batches
take the ATen-call paths on the bare projections). TorchScript is deprecated in recent torch releases: where
``torch.jit.script`` is missing or fails, the eager layers run.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from trtserver.engine.torch.cpu.decode_layers import DecodeLayers, DecodeStep, PathKind
from trtserver.engine.torch.cpu.decode_stack import Int4DecodeStack

if TYPE_CHECKING:
    from collections.abc import Callable

    from trtserver.engine.torch.cache import KVCache
    from trtserver.engine.torch.model import Block, ForwardContext, Transformer

log = logging.getLogger(__name__)
STACK_KIND = PathKind("int4_kernel", "kernel", fused=True)  # the path decode_stack.py's single call can take


@dataclass(frozen=True, slots=True)
class DecodePath:
    """The scripted layers of one path (small batches, or the rest), and how they compute."""

    layers: Callable[..., Tensor]
    kind: PathKind


class ScriptedDecode:
    """A decode step of ``model`` (embedding to final norm) through its layers as one TorchScript call,
    where it ``covers`` the step's path (small batch or not); the model runner calls it instead of the model
    for batches without adapters."""

    def __init__(self, model: Transformer, small: DecodePath | None, batch: DecodePath | None) -> None:
        self.model = model
        self._small, self._batch = small, batch
        # which paths run the fused kernels
        self.fused_small = small is not None and small.kind.fused
        self.fused_batch = batch is not None and batch.kind.fused

    def covers(self, small: bool) -> bool:
        return (self._small if small else self._batch) is not None

    def __call__(self, tokens: Tensor, ctx: ForwardContext, cache: KVCache) -> Tensor:
        """``model(tokens, ctx, cache)`` for a decode step: ``tokens`` (B, 1); hidden states (B, 1, dim).
        It runs the bare projections: never a batch with adapters."""
        model = self.model
        path = self._small if ctx.small else self._batch
        assert path is not None
        x = model.tok_embeddings(tokens)  # (B, 1, dim)
        B, _, dim = x.shape
        cos, sin = model.rope(ctx.pos)  # (B, 1, 1, head_dim)
        fused, attention = path.kind.fused, path.kind.attention
        shape = (B, -1) if fused else (B, 1, -1)
        mask = ctx.additive_mask() if attention == "sdpa" else ctx.mask if attention == "bmm" else None
        dense_k, dense_v = ctx.dense if ctx.dense is not None else (None, None)
        step = DecodeStep(ctx.slots, ctx.pos.view(-1), None if fused else ctx.cache_rows(cache.k[0]),
                          -1 if ctx.slot_start is None else ctx.slot_start, ctx.length, mask, dense_k, dense_v)
        # unoptimized: the profiling executor re-profiles every new batch shape, for graphs it cannot
        # fuse on the CPU anyway
        with torch.jit.optimized_execution(False):
            y = path.layers(x.view(B, dim), cos.view(shape), sin.view(shape), cache.k, cache.v, step)
        if fused:  # the final norm too: ATen's rms_norm takes ~0.15 ms on one row, the kernel microseconds
            return torch.ops.trtserver.rms_norm(y, model.norm.weight, model.norm.eps).view(B, 1, dim)
        return model.norm(y.view(B, 1, dim))


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


def _path(model: Transformer, kind: PathKind) -> DecodePath | None:
    projections = [_projections(layer) for layer in _blocks(model)]
    if kind == STACK_KIND and Int4DecodeStack.fits(model, projections):
        return DecodePath(Int4DecodeStack(model, projections), kind)
    layers = _script(DecodeLayers(model, projections, kind))
    return None if layers is None else DecodePath(layers, kind)


def _script(layers: DecodeLayers) -> Callable[..., Tensor] | None:
    script = getattr(torch.jit, "script", None)
    if script is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # deprecated, not gone: see the module's text
            return cast("Callable[..., Tensor]", script(layers))
    except Exception:  # noqa: BLE001 - any TorchScript failure leaves the eager layers in charge
        log.warning("TorchScript could not compile the decode layers; the eager layers run them", exc_info=True)
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
    quantized = kinds in ({Int4Linear}, {Int8Linear})
    packed = all(isinstance(getattr(p, "dense", p), PackedLinear) for p in projections) \
        and kinds <= {PackedLinear, Int4Linear, Int8Linear}
    int4_kernel = kinds == {Int4Linear} and all(getattr(p, "kernel_layout", False) for p in projections)
    dtype = model.tok_embeddings.weight.dtype
    fuse_small = quantized and dtype in (torch.bfloat16, torch.float32)
    # float32 batches keep the ATen calls: the fused RMSNorm and RoPE bring them nothing measurable
    fuse_batch = packed and dtype == torch.bfloat16
    if fused and (fuse_small or fuse_batch):
        from trtserver.engine.torch.cpu import kernels

        fused = kernels.load()
    else:
        fused = False
    small = batch = None
    if quantized:
        fused_small = fused and fuse_small
        projection = "int8" if kinds == {Int8Linear} else "int4_kernel" if int4_kernel else "aten_int4"
        small = _path(model, PathKind(projection, "kernel" if fused_small else "sdpa", fused_small))
    if packed:
        batch = _path(model, PathKind("packed", "bmm", fused and fuse_batch))
    if small is None and batch is None:
        return None
    return ScriptedDecode(model, small, batch)
