"""Which KV-cache slot a new request takes, and how much of its prompt is already computed there.

The cache is a fixed set of slots, each one sequence's K/V from position 0 (``cache.py``), so
prefixes are shared as llama.cpp's server shares them: a finished sequence's slot keeps its K/V and
the tokens they stand for (an *entry*), and a new prompt starts from the longest prefix it shares
with an entry or with a running request's prompt. A prompt that extends a whole entry takes its slot
as it is, and so does one sharing at least ``CLAIM_SHARE`` of it (a document's next question: its
entry's last question and answer are given up, as llama.cpp's server gives them up, rather than the
shared part copied, which would be most of the hit's time to first token); a shorter match is copied
into the request's own slot, so the entry stays whole.

Running sequences use only the first ``num_slots`` slots (a full batch then reads the cache through
one view); entries live in those of them that are free and in ``stash_slots`` more. A free slot is
taken empty first (lowest first), else from its least recently used entry, which moves to the stash
if it is more recent than the stash's own least recently used one. Only free slots hold entries, so
nothing a running request uses is ever evicted. Plain Python, no torch: the engine performs the
copies this module plans, in order, before the step computes anything.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

MIN_STASHED = 32  # shorter entries are cheaper to recompute than to keep
CLAIM_SHARE = 0.75  # a match covering this share of an entry takes the entry's slot instead of a copy


@dataclass(slots=True)
class Entry:
    tokens: list[int]  # the tokens whose K/V sit at positions 0..len-1 of the slot
    adapter: str | None  # K/V depend on the adapter: entries match only requests with the same one
    used: int  # a tick of the last use, for LRU


@dataclass(frozen=True, slots=True)
class Source:
    """A held slot whose first ``valid`` positions hold the K/V of ``tokens[:valid]``."""

    slot: int
    tokens: list[int]
    valid: int
    adapter: str | None


@dataclass(slots=True)
class Placement:
    slots: list[int] = field(default_factory=list)  # the request's slots; the first computes the prompt
    cached: int = 0  # prompt tokens already in ``slots[0]`` once ``copies`` are done
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # (from slot, to slot, positions), in order


@dataclass(slots=True)
class PrefixCache:
    """Free slots and their entries. ``enabled`` False: lowest free slot first, nothing reused."""

    num_slots: int
    stash_slots: int = 0
    enabled: bool = True
    entries: dict[int, Entry] = field(default_factory=dict)  # free running slots that hold K/V worth keeping
    stash: dict[int, Entry] = field(default_factory=dict)  # entries in the slots beyond ``num_slots``
    hit_tokens: int = 0
    miss_tokens: int = 0
    _empty: list[int] = field(default_factory=list)  # a heap of free running slots without an entry
    _clock: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self._empty = list(range(self.num_slots))

    def place(self, count: int, prompt: list[int], adapter: str | None, *, reuse: bool,
              held: Iterable[Source] = ()) -> Placement:
        """Take ``count`` free slots for a request with ``prompt`` (the caller checked there are that many)."""
        best, source, claim = 0, -1, False
        if self.enabled and reuse:
            limit = len(prompt) - 1  # the last prompt token is always computed: its logits start decoding
            for slot, candidate in itertools.chain(self.entries.items(), self.stash.items()):
                if candidate.adapter == adapter:
                    shared = common_prefix(candidate.tokens, prompt, len(prompt))
                    n = min(shared, limit)
                    takes = slot in self.entries and (shared >= len(candidate.tokens)
                                                      or n >= CLAIM_SHARE * len(candidate.tokens))
                    if n > best or (n == best and takes and not claim):
                        best, source, claim = n, slot, takes
            for s in held:
                if s.adapter == adapter:
                    n = common_prefix(s.tokens, prompt, min(limit, s.valid))
                    if n > best:
                        best, source, claim = n, s.slot, False
        placement = Placement(cached=best)
        entry = self.entries.get(source) if best else None
        if entry is not None and claim:  # the prompt starts with (nearly) the whole entry: it runs in that slot
            del self.entries[source]
            placement.slots.append(source)
        else:
            if entry is not None:
                entry.used = next(self._clock)  # kept whole, and now the most recent
            if source in self.stash:
                self.stash[source].used = next(self._clock)
            target = self._take(placement, avoid=source)
            if target is None:  # the source is the only free slot: compute into it
                del self.entries[source]
                target = source
            placement.slots.append(target)
            if best and target != source:
                placement.copies.append((source, target, best))
        while len(placement.slots) < count:
            free = self._take(placement, avoid=-1)
            assert free is not None, "place() was asked for more slots than are free"
            placement.slots.append(free)
        if self.enabled:
            self.hit_tokens += best
            self.miss_tokens += len(prompt) - best
        return placement

    def release(self, slot: int, tokens: list[int], adapter: str | None) -> None:
        """``slot`` is free again; its first ``len(tokens)`` positions hold their K/V."""
        if self.enabled and tokens:
            self.entries[slot] = Entry(tokens, adapter, next(self._clock))
        else:
            heapq.heappush(self._empty, slot)

    def next_target(self) -> int | None:
        """The running slot a new request's copied prefix would be written to next: the lowest empty one,
        else the least recently used entry's; None while every running slot is taken."""
        return self._empty[0] if self._empty else self._least_recent(avoid=-1)

    def longest_entry(self) -> int:
        return max((len(e.tokens) for e in itertools.chain(self.entries.values(), self.stash.values())), default=0)

    def clear(self) -> None:
        """Forget every entry (after a failed step, whose writes are unknown)."""
        for slot in self.entries:
            heapq.heappush(self._empty, slot)
        self.entries.clear()
        self.stash.clear()

    def _take(self, placement: Placement, avoid: int) -> int | None:
        """A free running slot to write: an empty one, else the least recently used entry's (but ``avoid``),
        the entry moving to the stash when it is worth more than what it would replace there."""
        if self._empty:
            return heapq.heappop(self._empty)
        slot = self._least_recent(avoid)
        if slot is None:
            return None
        entry = self.entries.pop(slot)
        if self.stash_slots and len(entry.tokens) >= MIN_STASHED:
            free = [s for s in range(self.num_slots, self.num_slots + self.stash_slots) if s not in self.stash]
            to = free[0] if free else min(self.stash, key=lambda s: self.stash[s].used)
            if free or self.stash[to].used < entry.used:
                self.stash[to] = entry
                placement.copies.append((slot, to, len(entry.tokens)))
        return slot

    def _least_recent(self, avoid: int) -> int | None:
        """The running slot of the least recently used entry, but ``avoid``; None when there is none."""
        candidates = [(e.used, slot) for slot, e in self.entries.items() if slot != avoid]
        return min(candidates)[1] if candidates else None


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``limit``; slices compare in C."""
    n = min(len(a), len(b), limit)
    if n <= 0 or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
