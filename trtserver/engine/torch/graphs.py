"""CUDA graphs for the batched decode step (CUDA only; the CPU path never imports this).

A captured step covers the first ``rows`` slots, row ``s`` being slot ``s``: the K/V cache is read
through a view (no gather), and rows whose slot has nothing to decode write a dummy token into the
cache's scratch position, which nothing reads. One graph per (rows, attention length) bucket, both
powers of two up to ``num_slots`` and ``max_len``, all sharing one memory pool. A step replays the
smallest bucket that holds its highest slot and its longest sequence, and picks its rows out of the
logits. The scheduler hands out the lowest free slot, so a batch of ``b`` sits in about the first
``b`` slots: one stream reads its own keys, not every slot's (at 64 slots and 256 positions that is
377 MB a step for SmolLM2-135M, more than its 269 MB of weights). With ``batch_invariant`` every
step runs all slots, so the matmuls keep one shape whatever the batch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from trtserver.engine.torch.attention import decode_attention
from trtserver.engine.torch.model import ForwardContext

if TYPE_CHECKING:
    from trtserver.engine.torch.model_runner import ModelRunner
    from trtserver.engine.torch.sequence import Sequence

log = logging.getLogger(__name__)

Bucket = tuple[int, int]  # (rows, attention length)


def powers_of_two(low: int, high: int) -> list[int]:
    """low, 2 low, 4 low, ... below ``high``, then ``high``."""
    out, b = [], low
    while b < high:
        out.append(b)
        b *= 2
    return [*out, high]


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, min_length: int = 256, all_rows: bool = False) -> None:
        self.runner = runner
        cache, device = runner.cache, runner.device
        self.num_slots, self.max_len = cache.num_slots, cache.max_len
        S = self.num_slots
        self.tokens = torch.zeros((S, 1), dtype=torch.long, device=device)
        self.pos = torch.full((S, 1), cache.scratch_pos, dtype=torch.long, device=device)
        self.slots = torch.arange(S, device=device)
        self.row_buckets = [S] if all_rows else powers_of_two(1, S)
        self.length_buckets = powers_of_two(min_length, self.max_len)
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self.logits: dict[Bucket, Tensor] = {}

    def _step(self, bucket: Bucket) -> Tensor:
        rows, length = bucket
        runner, pos = self.runner, self.pos[:rows]
        mask = (runner.positions[:length] <= pos).view(rows, 1, 1, length)  # (rows, 1, 1, L)
        ctx = ForwardContext(pos, self.slots[:rows], 0, length, mask, attend=decode_attention)
        hidden = runner.model(self.tokens[:rows], ctx, runner.cache)  # (rows, 1, dim)
        return runner.model.logits(hidden[:, 0])  # (rows, V)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        buckets = [(r, n) for r in self.row_buckets for n in self.length_buckets]
        for bucket in sorted(buckets, reverse=True):  # largest first: the pool fits them all
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._step(bucket)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bucket] = self._step(bucket)
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs (rows %s; lengths %s)", len(self.graphs), self.row_buckets,
                 self.length_buckets)

    def bucket(self, seqs: list[Sequence]) -> Bucket:
        top = max(seq.slot for seq in seqs) + 1
        need = max(seq.num_cached for seq in seqs) + 1
        return next(r for r in self.row_buckets if r >= top), next(n for n in self.length_buckets if n >= need)

    def load_inputs(self, seqs: list[Sequence]) -> Bucket:
        """Write the step's tokens and positions into the graphs' input buffers; return its bucket."""
        bucket = self.bucket(seqs)
        rows, scratch = bucket[0], self.runner.cache.scratch_pos
        tokens, pos = [0] * rows, [scratch] * rows
        for seq in seqs:
            tokens[seq.slot] = seq.last_token
            pos[seq.slot] = seq.num_cached
        self.tokens[:rows].copy_(self._host(tokens).view(rows, 1), non_blocking=True)
        self.pos[:rows].copy_(self._host(pos).view(rows, 1), non_blocking=True)
        return bucket

    def run(self, bucket: Bucket) -> Tensor:
        self.graphs[bucket].replay()
        return self.logits[bucket]

    def decode(self, seqs: list[Sequence]) -> Tensor:
        logits = self.run(self.load_inputs(seqs))
        rows = self._host([seq.slot for seq in seqs]).to(self.tokens.device, non_blocking=True)
        return logits.index_select(0, rows)  # (B, V); the sampler modifies it in place

    def _host(self, values: list[int]) -> Tensor:
        """Pinned on CUDA, so that the copy to the GPU does not block (the tests drive the bucketing on
        the CPU, running ``_step`` where a graph would replay)."""
        t = torch.tensor(values)
        return t.pin_memory() if self.tokens.is_cuda else t


def capture_decode_graphs(runner: ModelRunner, all_rows: bool = False) -> None:
    if runner.device.type != "cuda":
        return
    graphs = DecodeGraphs(runner, all_rows=all_rows)
    graphs.capture()
    runner.graphs = graphs
