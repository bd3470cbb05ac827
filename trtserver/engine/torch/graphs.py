"""CUDA graphs for the batched decode step (CUDA only; the CPU path never imports this).

Decode on a GPU is bound by reading weights, so running every slot costs about what running
one does. A captured step therefore always covers all ``num_slots`` rows, row ``s`` being slot
``s``: the K/V cache is read through a view (no gather), and idle rows decode a dummy token
into the cache's scratch position, which nothing reads. One graph per attention length bucket
(powers of two up to ``max_len``), all sharing one memory pool; a step replays the smallest
bucket that covers its longest sequence and picks its rows out of the logits.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from trtserver.engine.torch.model import ForwardContext

if TYPE_CHECKING:
    from trtserver.engine.torch.core import EngineCore
    from trtserver.engine.torch.sequence import Sequence

log = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(self, core: EngineCore, min_bucket: int = 256) -> None:
        self.core = core
        cache, device = core.cache, core.device
        self.num_slots, self.max_len = cache.num_slots, cache.max_len
        S = self.num_slots
        self.tokens = torch.zeros((S, 1), dtype=torch.long, device=device)
        self.pos = torch.full((S, 1), cache.scratch_pos, dtype=torch.long, device=device)
        self.slots = torch.arange(S, device=device)
        buckets, b = [], min_bucket
        while b < self.max_len:
            buckets.append(b)
            b *= 2
        self.buckets = [*buckets, self.max_len]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, Tensor] = {}

    def _step(self, length: int) -> Tensor:
        core = self.core
        S = self.num_slots
        mask = (core._positions[:length] <= self.pos).view(S, 1, 1, length)  # (S, 1, 1, L)
        ctx = ForwardContext(self.pos, self.slots, 0, length, mask)
        hidden = core.model(self.tokens, ctx, core.cache)  # (S, 1, dim)
        return core.model.logits(hidden[:, 0])  # (S, V)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for length in sorted(self.buckets, reverse=True):  # largest first: the pool fits them all
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._step(length)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[length] = self._step(length)
            pool = graph.pool()
            self.graphs[length] = graph
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs (%d slots; lengths %s)", len(self.graphs), self.num_slots,
                 self.buckets)

    def decode(self, seqs: list[Sequence]) -> Tensor:
        S, scratch = self.num_slots, self.core.cache.scratch_pos
        tokens, pos = [0] * S, [scratch] * S
        for seq in seqs:
            tokens[seq.slot] = seq.last_token
            pos[seq.slot] = seq.num_cached
        need = max(seq.num_cached for seq in seqs) + 1
        length = next(b for b in self.buckets if b >= need)
        self.tokens.copy_(torch.tensor(tokens, pin_memory=True).view(S, 1), non_blocking=True)
        self.pos.copy_(torch.tensor(pos, pin_memory=True).view(S, 1), non_blocking=True)
        self.graphs[length].replay()
        rows = torch.tensor([seq.slot for seq in seqs], pin_memory=True).to(self.tokens.device, non_blocking=True)
        return self.logits[length].index_select(0, rows)  # (B, V); the sampler modifies it in place


def capture_decode_graphs(core: EngineCore) -> None:
    if core.device.type != "cuda":
        return
    graphs = DecodeGraphs(core)
    graphs.capture()
    core.graphs = graphs
