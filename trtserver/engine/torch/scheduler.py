"""Which sequences run in the next step. Plain Python, no torch.

Every request (a ``Group`` of ``n`` sequences) holds ``n`` fixed KV-cache slots from admission
until it finishes, so nothing is ever preempted. Admission is by priority, then arrival; the
head of the queue is never skipped, so a wide request cannot starve. A step is one prefill
chunk (at most ``chunk_size`` padded tokens, from one or more admitted prompts) plus one
batched decode of every running sequence: a long prompt delays decodes by one chunk per
step, never more.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from trtserver.engine.torch.sequence import Group, Sequence, Status


@dataclass(slots=True)
class PrefillChunk:
    group: Group
    start: int
    end: int

    @property
    def last(self) -> bool:
        return self.end >= self.group.prompt_len


@dataclass(slots=True)
class ScheduledStep:
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


class Scheduler:
    def __init__(self, num_slots: int, chunk_size: int) -> None:
        self.num_slots = num_slots
        self.chunk_size = chunk_size
        self.free_slots = list(range(num_slots))  # a heap: lowest slot first keeps batches contiguous
        self.waiting: list[tuple[int, int, Group]] = []  # heap of (priority, arrival, group)
        self.prefilling: list[Group] = []  # admitted, prompt not fully computed, in admission order
        self.running: set[Sequence] = set()
        self.groups: dict[str, Group] = {}

    # ---- requests in and out -------------------------------------------------------------
    def add(self, group: Group) -> None:
        if group.num_slots > self.num_slots:
            raise ValueError(f"n={group.num_slots} needs more KV slots than the {self.num_slots} configured")
        if group.request_id in self.groups:
            raise ValueError(f"request id {group.request_id!r} is already running")
        self.groups[group.request_id] = group
        heapq.heappush(self.waiting, (group.priority, group.arrival, group))

    def finish(self, seq: Sequence) -> None:
        """Mark ``seq`` finished (its finish_reason already set) and free its slot."""
        if seq.status is Status.FINISHED:
            return
        seq.status = Status.FINISHED
        self.running.discard(seq)
        if seq.slot >= 0:
            heapq.heappush(self.free_slots, seq.slot)
            seq.slot = -1
        group = seq.group
        if group.finished:
            self.groups.pop(group.request_id, None)
            if group in self.prefilling:
                self.prefilling.remove(group)

    def abort(self, request_id: str, index: int | None = None) -> list[Sequence]:
        """Finish one sequence or the whole request with "abort"; returns those it stopped."""
        group = self.groups.get(request_id)
        if group is None:
            return []
        targets = [s for s in group.seqs if not s.finished and (index is None or s.index == index)]
        was_waiting = all(s.status is Status.WAITING for s in group.seqs)
        for seq in targets:
            if seq.slot == group.prefill_slot and seq.status is Status.PREFILL:
                # the prompt's K/V are being written to this slot: hand it to a surviving sequence
                heir = next((s for s in group.seqs if s not in targets and not s.finished), None)
                if heir is not None:
                    seq.slot, heir.slot = heir.slot, seq.slot
            seq.finish_reason = "abort"
            self.finish(seq)
        if group.finished and was_waiting:
            self.waiting = [w for w in self.waiting if w[2] is not group]
            heapq.heapify(self.waiting)
        return targets

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        self._admit()
        step = ScheduledStep(decode=sorted(self.running, key=_slot))
        budget = self.chunk_size
        width = 0
        for group in self.prefilling:
            remaining = group.prompt_len - group.prefill_pos
            if not step.prefill:
                width = min(remaining, budget)
            elif (len(step.prefill) + 1) * width > budget:
                break
            step.prefill.append(PrefillChunk(group, group.prefill_pos, group.prefill_pos + min(remaining, width)))
        return step

    def prefilled(self, chunk: PrefillChunk) -> None:
        """Record a computed chunk; a finished prompt moves its sequences to decoding."""
        group = chunk.group
        group.prefill_pos = chunk.end
        if chunk.last and group in self.prefilling:
            self.prefilling.remove(group)
            for seq in group.seqs:
                if not seq.finished:
                    seq.status = Status.RUNNING
                    seq.num_cached = chunk.end
                    self.running.add(seq)

    def _admit(self) -> None:
        while self.waiting:
            group = self.waiting[0][2]
            if group.finished:  # aborted while waiting
                heapq.heappop(self.waiting)
                continue
            if group.num_slots > len(self.free_slots):
                return
            heapq.heappop(self.waiting)
            for seq in group.seqs:
                if not seq.finished:
                    seq.slot = heapq.heappop(self.free_slots)
                    seq.status = Status.PREFILL
            group.prefill_slot = next(seq.slot for seq in group.seqs if not seq.finished)
            self.prefilling.append(group)

    # ---- numbers -------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.groups) - len(self.waiting)

    @property
    def slots_used(self) -> int:
        return self.num_slots - len(self.free_slots)


def _slot(seq: Sequence) -> int:
    return seq.slot
