"""Running the model for ``EngineCore`` (nano-vllm's ``ModelRunner``): a step's input tensors built into a
``ForwardContext``, the batch's LoRA adapters bound, the thread count set, and the forward that fits it.

A prefill forward runs the eager layers (``model.py``). A decode step takes, in this order: a captured CUDA
graph (``graphs.py``; batches without adapters), the CPU decode function (``cpu.accelerate``: one
TorchScript call for every layer; batches without adapters, on the paths it covers), else the eager layers,
with the decode attention for its batch (``attention.py``, ``cpu/attention.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from trtserver.engine.torch.attention import decode_attention
from trtserver.engine.torch.cache import KVCache
from trtserver.engine.torch.cpu.attention import dense_attention, small_attention
from trtserver.engine.torch.cpu.weights import kernel_switch
from trtserver.engine.torch.model import Attend, ForwardContext, Transformer, sdpa_attention

if TYPE_CHECKING:
    from trtserver.engine.torch.lora import LoraManager
    from trtserver.engine.torch.scheduler import PrefillChunk
    from trtserver.engine.torch.sequence import Sequence

class GraphedDecode(Protocol):
    """What the runner needs of the captured decode graphs (``graphs.DecodeGraphs``, which takes the runner)."""

    def decode(self, seqs: list[Sequence]) -> Tensor: ...


SMALL_BATCH = 4
"""Decode batches up to this many rows take the small-batch kernels (CPU): float32 attention and the
quantized projections. Above it, and for prefill, the bfloat16 kernels are faster; the two sets round
differently, so ``batch_invariant`` turns the small-batch set off."""


class DecodeFn(Protocol):
    """A decode step through every layer in one call (``cpu.accelerate``): ``model(tokens, ctx, cache)``
    for the paths it ``covers`` (small batch or not), run on the bare projections."""

    def covers(self, small: bool) -> bool: ...

    def __call__(self, tokens: Tensor, ctx: ForwardContext, cache: KVCache) -> Tensor: ...


class ModelRunner:
    def __init__(self, model: Transformer, cache: KVCache, *, device: torch.device, max_len: int,
                 small_batch: int = 0, threads: tuple[int, int] | None = None, lora: LoraManager | None = None,
                 decode: DecodeFn | None = None) -> None:
        """``small_batch``: decode batches of up to this many rows take the small-batch kernels
        (``SMALL_BATCH``: float32 attention, quantized projections); 0 = never.

        ``threads`` (CPU): torch threads for forwards of up to ``small_batch`` rows, or ``SMALL_BATCH`` (decode GEMVs,
        bound by reading weights: a second thread's hand-over costs more than it brings) and for
        larger ones (prefill, big decode batches: their GEMMs are compute-bound and scale with the
        cores); None = leave torch's setting alone.

        ``decode``: the accelerated decode (``cpu.accelerate(model)``), or None."""
        self.model, self.cache, self.device, self.max_len = model, cache, device, max_len
        model.setup_rope(max_len)
        self.positions = torch.arange(max_len + 1, device=device)
        dtype = model.tok_embeddings.weight.dtype
        self.dense = cache.dense if dtype == torch.bfloat16 else None  # CPU only (None on CUDA)
        self.small_batch = small_batch
        self.threads = threads
        self._threads_now = 0
        self.lora = lora
        self.accelerated = decode
        self.kernels = kernel_switch(model)  # the quantized projections' small-batch switch, if any
        self.graphs: GraphedDecode | None = None  # on CUDA (graphs.py)

    def prefill(self, chunks: list[PrefillChunk]) -> Tensor:
        """Hidden states of every chunk's tokens, ``(B, T, dim)``, row b chunk b, padded at the end."""
        B, T = len(chunks), max(c.end - c.start for c in chunks)
        tokens = torch.zeros((B, T), dtype=torch.long)
        pos = torch.full((B, T), self.cache.scratch_pos, dtype=torch.long)
        for b, c in enumerate(chunks):
            n = c.end - c.start
            tokens[b, :n] = torch.tensor(c.group.request.prompt_token_ids[c.start:c.end])
            pos[b, :n] = torch.arange(c.start, c.end)
        slots = [c.group.prefill_slot for c in chunks]
        length = max(c.end for c in chunks)
        causal = B == 1 and chunks[0].start == 0
        pos = pos.to(self.device)
        mask = None if causal else (self.positions[:length] <= pos.unsqueeze(-1)).unsqueeze(1)  # (B, 1, T, L)
        attend = decode_attention if T == 1 else sdpa_attention  # a one-token chunk attends as a decode step
        ctx = ForwardContext(pos, torch.tensor(slots, device=self.device), contiguous(slots), length, mask, causal,
                             attend)
        adapters = self.lora is not None and self.lora.bind([c.group.adapter for c in chunks])
        self.use_threads(sum(c.end - c.start for c in chunks))
        return self.forward(tokens.to(self.device), ctx, adapters=adapters)

    def decode(self, seqs: list[Sequence]) -> Tensor:
        """The next-token logits of each sequence, ``(B, V)``, its last token written to the cache."""
        adapters = self.lora is not None and self.lora.bind([s.group.adapter for s in seqs])
        if self.graphs is not None and not adapters:  # graphs are captured without adapters
            return self.graphs.decode(seqs)  # (B, V), from a captured CUDA graph
        ctx = self.decode_context([s.slot for s in seqs], [s.num_cached for s in seqs])
        tokens = torch.tensor([[s.last_token] for s in seqs], device=self.device)  # (B, 1)
        self.use_threads(len(seqs))
        hidden = self.forward(tokens, ctx, adapters=adapters)  # (B, 1, dim)
        return self.model.logits(hidden[:, 0])  # (B, V)

    def decode_context(self, slots: list[int], positions: list[int], *, small: bool | None = None) -> ForwardContext:
        """A decode step's rows, one token each at ``positions``; ``small`` (by default: up to
        ``small_batch`` rows) takes the small-batch kernels."""
        B = len(slots)
        small = B <= self.small_batch if small is None else small
        pos = torch.tensor(positions, device=self.device).unsqueeze(1)  # (B, 1)
        length = min(attention_length(max(positions) + 1), self.max_len + 1)
        mask = (self.positions[:length] <= pos).view(B, 1, 1, length)  # (B, 1, 1, L)
        attend: Attend = small_attention if small else decode_attention if self.dense is None else dense_attention
        return ForwardContext(pos, torch.tensor(slots, device=self.device), contiguous(slots), length, mask,
                              attend=attend, small=small, dense=self.dense)

    def forward(self, tokens: Tensor, ctx: ForwardContext, *, adapters: bool = False) -> Tensor:
        """``model(tokens, ctx, cache)``, through the accelerated decode where it covers a one-token
        forward without adapters; the quantized projections (and the ``logits`` after) follow ``ctx.small``."""
        if self.kernels is not None:
            self.kernels.small = ctx.small
        fast = self.accelerated
        if fast is not None and tokens.shape[1] == 1 and not adapters and fast.covers(ctx.small):
            return fast(tokens, ctx, self.cache)
        return self.model(tokens, ctx, self.cache)

    def use_threads(self, rows: int) -> None:
        if self.threads is not None:
            n = self.threads[rows > (self.small_batch or SMALL_BATCH)]
            if n != self._threads_now:  # set only on a change; the setting stays for the sampler too
                torch.set_num_threads(n)
                self._threads_now = n


def attention_length(n: int) -> int:
    """``n`` rounded up to one of 8 lengths per octave (at least a multiple of 16); decode attends
    over that many keys with the tail masked. oneDNN builds a kernel for every new shape, and a
    length that grows by one each step would need a new one every step."""
    granule = max(16, 1 << max(0, n.bit_length() - 4))
    return -(-n // granule) * granule


def contiguous(slots: list[int]) -> int | None:
    """The first slot when ``slots`` are consecutive and ascending (the cache is then a view)."""
    first = slots[0]
    return first if slots[-1] - first == len(slots) - 1 and slots == list(range(first, first + len(slots))) else None
