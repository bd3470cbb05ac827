"""Which sequences run in the next step. Plain Python, no torch.

Every request (a ``Group`` of ``n`` sequences) holds ``n`` fixed KV-cache slots from admission
until it finishes, so nothing is ever preempted; which free slots it takes, and how much of its
prompt they already hold, is the prefix cache's choice (``prefix_cache.py``). Admission is by
priority, then arrival; the head of the queue is never skipped, so a wide request cannot starve. A step is one prefill
chunk (at most ``chunk_size`` padded tokens, from one or more admitted prompts) plus one
batched decode of every running sequence: a long prompt delays decodes by one chunk per
step, never more.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field

from trtserver.engine.torch.prefix_cache import PrefixCache, Source
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
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # (from slot, to slot, positions), first

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


class Scheduler:
    def __init__(self, num_slots: int, chunk_size: int, *, cache_slots: int = 0, prefix_cache: bool = False) -> None:
        """``num_slots`` sequences run at once; ``cache_slots`` more slots only keep cached prefixes."""
        self.num_slots = num_slots
        self.chunk_size = chunk_size
        self.prefix = PrefixCache(num_slots, stash_slots=cache_slots, enabled=prefix_cache)
        self.slots_used = 0  # running slots taken (the extra cache slots never run)
        self._copies: list[tuple[int, int, int]] = []
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
        was = seq.status
        seq.status = Status.FINISHED
        self.running.discard(seq)
        if seq.slot >= 0:
            self.prefix.release(seq.slot, _cached_tokens(seq, was), seq.group.request.adapter)
            self.slots_used -= 1
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

    def next_copy_target(self) -> tuple[int, int] | None:
        """The slot the next cached prefix copied for a new request would be written to, and as many positions
        as such a copy could need: the longest entry, running sequence or prompt being computed. None
        without a prefix cache or a free slot."""
        slot = self.prefix.next_target() if self.prefix.enabled else None
        if slot is None:
            return None
        longest = max(self.prefix.longest_entry(), max((s.num_cached for s in self.running), default=0),
                      max((g.prompt_len for g in self.prefilling), default=0))
        return (slot, longest) if longest else None

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        self._admit()
        step = ScheduledStep(decode=sorted(self.running, key=_slot), copies=self._copies)
        self._copies = []
        # prompts in admission order, padded to one width: as wide as the longest remainder allows within
        # the budget, so that one nearly computed prompt (a cached prefix) does not narrow everyone's chunk
        budget = self.chunk_size
        width = 0
        chosen: list[Group] = []
        for group in self.prefilling:
            remaining = group.prompt_len - group.prefill_pos
            wider = min(max(width, remaining), budget)
            if (len(chosen) + 1) * wider <= budget:
                width = wider
            elif (len(chosen) + 1) * width > budget:
                break  # else it takes a first piece at the present width
            chosen.append(group)
        step.prefill = [PrefillChunk(g, g.prefill_pos, g.prefill_pos + min(g.prompt_len - g.prefill_pos, width))
                        for g in chosen]
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
            live = [seq for seq in group.seqs if not seq.finished]
            if len(live) > self.num_slots - self.slots_used:
                return
            heapq.heappop(self.waiting)
            request = group.request
            # prompt scoring needs every prompt position computed; a seed asks for the text its prompt alone
            # gives: a prefix computed in another chunk shape can differ by rounding, and move a sample; beam
            # search ranks sums of many candidates, and such a difference swaps two near-tied hypotheses
            p = request.sampling
            reuse = group.prompt_token_logprobs is None and p.seed is None and not p.use_beam_search
            placement = self.prefix.place(len(live), request.prompt_token_ids, request.adapter, reuse=reuse,
                                          held=self._sources())
            for seq, slot in zip(live, placement.slots):
                seq.slot = slot
                seq.status = Status.PREFILL
            self.slots_used += len(live)
            group.prefill_slot = placement.slots[0]
            group.prefill_pos = group.cached_tokens = placement.cached
            self._copies += placement.copies
            self.prefilling.append(group)

    def _sources(self) -> Iterator[Source]:
        """Held slots whose prompt K/V a new request may copy: what each has computed of its prompt."""
        for group in self.groups.values():
            if group.prefill_slot < 0:
                continue  # still waiting
            if group.prefill_done:
                seq = next((s for s in group.seqs if s.status is Status.RUNNING), None)
                if seq is not None:
                    yield Source(seq.slot, group.request.prompt_token_ids, group.prompt_len, group.request.adapter)
            elif group.prefill_pos and not group.finished:
                yield Source(group.prefill_slot, group.request.prompt_token_ids, group.prefill_pos,
                             group.request.adapter)

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


def _slot(seq: Sequence) -> int:
    return seq.slot


def _cached_tokens(seq: Sequence, status: Status) -> list[int]:
    """The tokens whose K/V ``seq``'s slot holds as it is freed, from position 0."""
    group = seq.group
    prompt = group.request.prompt_token_ids
    if status is Status.PREFILL:
        return prompt[:group.prefill_pos] if seq.slot == group.prefill_slot else []
    if group.beam is not None:  # beams swap their generated K/V between slots: only the prompt is sure
        return prompt[:min(seq.num_cached, len(prompt))]
    return (prompt + seq.output_ids)[:seq.num_cached]
