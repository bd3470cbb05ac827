"""Which KV-cache slot a new request takes, and how much of its prompt is already computed there.

The cache is a fixed set of slots, each one sequence's K/V from position 0 (``cache.py``), so
prefixes are shared as llama.cpp's server shares them: a finished sequence's slot keeps its K/V and
the tokens they stand for (an *entry*), and a new prompt starts from the longest prefix it shares
with an entry or with a running request's prompt. A fully matched entry is taken as it is; a
partial match is copied into another slot, so the entry stays whole for the next request. Only free
slots hold entries, so nothing a running request uses is ever evicted; when a slot is needed, empty
slots go first (lowest first, which keeps decode batches contiguous), then the least recently used
entry. Plain Python, no torch: the engine performs the copies this module plans.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field


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
    slots: list[int]  # the request's slots; the first computes the prompt
    cached: int = 0  # prompt tokens already in ``slots[0]`` (after ``copy``)
    copy: tuple[int, int, int] | None = None  # (from slot, to slot, positions) to copy before computing


@dataclass(slots=True)
class PrefixCache:
    """Free slots and their entries. ``enabled`` False: lowest free slot first, nothing reused."""

    num_slots: int
    enabled: bool = True
    entries: dict[int, Entry] = field(default_factory=dict)  # free slots that hold K/V worth keeping
    hit_tokens: int = 0
    miss_tokens: int = 0
    _empty: list[int] = field(default_factory=list)  # a heap of free slots without an entry
    _clock: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self._empty = list(range(self.num_slots))

    @property
    def num_free(self) -> int:
        return len(self._empty) + len(self.entries)

    def place(self, count: int, prompt: list[int], adapter: str | None, *, reuse: bool,
              held: Iterable[Source] = ()) -> Placement:
        """Take ``count`` free slots for a request with ``prompt`` (the caller checked there are that many)."""
        best, source, from_entry = 0, -1, False
        if self.enabled and reuse:
            limit = len(prompt) - 1  # the last prompt token is always computed: its logits start decoding
            for slot, entry in self.entries.items():
                if entry.adapter == adapter:
                    n = common_prefix(entry.tokens, prompt, limit)
                    if n > best:
                        best, source, from_entry = n, slot, True
            for s in held:
                if s.adapter == adapter:
                    n = common_prefix(s.tokens, prompt, min(limit, s.valid))
                    if n > best:
                        best, source, from_entry = n, s.slot, False
        placement = Placement([])
        if from_entry and best >= len(self.entries[source].tokens):  # the prompt extends the whole entry
            del self.entries[source]
            placement.slots.append(source)
        elif best:
            if from_entry:
                self.entries[source].used = next(self._clock)  # kept whole, and now the most recent
            target = self._evict(avoid=source)
            if target is None:  # the source is the only free slot: compute into it
                del self.entries[source]
                target = source
            placement.slots.append(target)
            if target != source:
                placement.copy = (source, target, best)
        placement.cached = best
        while len(placement.slots) < count:
            free = self._evict(avoid=-1)
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

    def clear(self) -> None:
        """Forget every entry (after a failed step, whose writes are unknown)."""
        for slot in self.entries:
            heapq.heappush(self._empty, slot)
        self.entries.clear()

    def _evict(self, avoid: int) -> int | None:
        """A free slot to write: an empty one, else the least recently used entry but ``avoid``."""
        if self._empty:
            return heapq.heappop(self._empty)
        candidates = [(e.used, slot) for slot, e in self.entries.items() if slot != avoid]
        if not candidates:
            return None
        _, slot = min(candidates)
        del self.entries[slot]
        return slot


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
