"""The prefix cache's slot choice (torch-free): reuse, copies, LRU eviction, adapters, and the
scheduler's use of it."""

from __future__ import annotations

import random

from trtserver.engine.base import GenerationRequest, SamplingParams
from trtserver.engine.torch.prefix_cache import PrefixCache, Source, common_prefix
from trtserver.engine.torch.scheduler import Scheduler
from trtserver.engine.torch.sequence import Group, Status


def test_common_prefix_against_a_plain_loop() -> None:
    rng = random.Random(0)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        b = a[:rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 10))]
        limit = rng.randrange(0, 50)
        expected = 0
        while expected < min(len(a), len(b), limit) and a[expected] == b[expected]:
            expected += 1
        assert common_prefix(a, b, limit) == expected, (a, b, limit)


def cache_with(num_slots: int, entries: dict[int, list[int]], stash_slots: int = 0,
               adapter: str | None = None) -> PrefixCache:
    """A cache whose running slots were all used once; ``entries`` says what each kept (others: nothing)."""
    cache = PrefixCache(num_slots, stash_slots=stash_slots)
    taken = cache.place(num_slots, [0], None, reuse=True).slots
    assert sorted(taken) == list(range(num_slots))
    for slot in range(num_slots):  # released in slot order: the lowest slot is the least recently used
        cache.release(slot, entries.get(slot, []), adapter)
    return cache


def test_a_prompt_extending_an_entry_takes_its_slot() -> None:
    cache = PrefixCache(4)
    first = cache.place(1, [1, 2, 3, 4], None, reuse=True)
    assert first.slots == [0] and first.cached == 0
    cache.release(0, [1, 2, 3, 4, 9], None)  # prompt + one generated token cached
    again = cache.place(1, [1, 2, 3, 4, 9, 7, 7], None, reuse=True)
    assert again.slots == [0] and again.cached == 5 and again.copies == []
    assert cache.hit_tokens == 5 and cache.miss_tokens == 4 + 2


def test_the_last_prompt_token_is_always_computed() -> None:
    cache = cache_with(2, {0: [1, 2, 3], 1: [5, 6, 7, 8]})
    assert cache.place(1, [1, 2, 3], None, reuse=True).cached == 2  # its logits start decoding
    assert cache.place(1, [5, 6], None, reuse=True).cached == 1


def test_a_partial_match_is_copied_and_the_entry_kept_whole() -> None:
    cache = cache_with(3, {1: [1, 2, 3, 4, 5, 6]})
    placement = cache.place(1, [1, 2, 3, 9], None, reuse=True)
    assert placement.cached == 3 and placement.slots == [0]
    assert placement.copies == [(1, 0, 3)]
    assert 1 in cache.entries  # the document and its first question stay for the next one


def test_a_match_covering_most_of_an_entry_takes_its_slot_and_gives_up_the_rest() -> None:
    """A document's next question shares all of the last one's entry but its question and answer: the request runs
    in that slot, with no copy; a match of less than ``CLAIM_SHARE`` of the entry still copies."""
    document = list(range(100, 130))
    cache = cache_with(3, {1: document + [7, 8, 9, 10]})  # 30 of its 34 tokens are the document
    placement = cache.place(1, document + [5, 6], None, reuse=True)
    assert placement.slots == [1] and placement.cached == 30 and placement.copies == []
    assert 1 not in cache.entries
    cache = cache_with(3, {1: document[:20] + list(range(200, 230))})  # 20 of 50 shared: copied
    placement = cache.place(1, document + [5, 6], None, reuse=True)
    assert placement.slots == [0] and placement.cached == 20 and placement.copies == [(1, 0, 20)]
    assert 1 in cache.entries


def test_no_shared_token_means_no_reuse_and_the_lowest_empty_slot() -> None:
    cache = cache_with(3, {2: [1, 2, 3]})
    placement = cache.place(1, [7, 2, 3], None, reuse=True)
    assert placement.slots == [0] and placement.cached == 0 and placement.copies == []
    assert 2 in cache.entries


def test_entries_are_evicted_least_recently_used_first() -> None:
    cache = cache_with(3, {0: [10, 1, 2], 1: [20, 1, 2], 2: [30, 1, 2]})
    hit = cache.place(1, [10, 1, 2, 5], None, reuse=True)  # slot 0's entry, taken whole
    assert hit.slots == [0] and hit.cached == 3
    cache.release(0, [10, 1, 2, 5], None)  # slot 0 is now the most recent
    assert cache.place(1, [99, 1], None, reuse=True).slots == [1]  # the oldest entry goes
    assert set(cache.entries) == {0, 2}


def test_evicted_entries_move_to_the_stash_and_come_back() -> None:
    doc, other = list(range(100, 150)), list(range(200, 250))
    cache = cache_with(2, {0: doc, 1: other}, stash_slots=1)
    placement = cache.place(1, [7, 8], None, reuse=True)  # nothing shared: slot 0's entry is the oldest
    assert placement.slots == [0] and placement.copies == [(0, 2, 50)]  # saved before slot 0 is written
    assert cache.stash[2].tokens == doc
    back = cache.place(1, doc + [1], None, reuse=True)  # runs in a running slot, copied from the stash
    assert back.slots == [1] and back.cached == 50
    # slot 1's entry is older than the stashed document, just used: it is dropped, not stashed over it
    assert back.copies == [(2, 1, 50)] and cache.stash[2].tokens == doc


def test_short_or_older_entries_are_not_stashed() -> None:
    cache = cache_with(2, {0: [1, 2, 3], 1: list(range(300, 340))}, stash_slots=1)
    assert cache.place(1, [9], None, reuse=True).copies == []  # 3 tokens: recomputing is cheaper
    assert cache.place(1, [9, 9], None, reuse=True).copies == [(1, 2, 40)]
    cache.release(0, list(range(400, 440)), None)
    cache.release(1, list(range(500, 540)), None)
    cache.stash[2].used = 10**9  # the stash's entry is the most recent: an evicted one is dropped
    placement = cache.place(1, [8], None, reuse=True)
    assert placement.copies == [] and cache.stash[2].tokens == list(range(300, 340))


def test_entries_match_only_their_adapter() -> None:
    cache = cache_with(3, {0: [1, 2, 3, 4]}, adapter="sql")
    assert cache.place(1, [1, 2, 3, 4, 5], None, reuse=True).cached == 0
    assert cache.place(1, [1, 2, 3, 4, 5], "other", reuse=True).cached == 0
    assert cache.place(1, [1, 2, 3, 4, 5], "sql", reuse=True).cached == 4


def test_held_slots_are_copied_from_never_taken() -> None:
    cache = PrefixCache(3)
    taken = cache.place(1, [1, 2, 3, 4, 5], None, reuse=True).slots
    running = Source(taken[0], [1, 2, 3, 4, 5], valid=5, adapter=None)
    placement = cache.place(2, [1, 2, 3, 4, 8], None, reuse=True, held=[running])
    assert placement.cached == 4 and placement.copies == [(taken[0], placement.slots[0], 4)]
    assert taken[0] not in placement.slots and len(set(placement.slots)) == 2
    half = Source(taken[0], [1, 2, 3, 4, 5], valid=2, adapter=None)  # still prefilling: 2 positions written
    assert PrefixCache(2).place(1, [1, 2, 3, 4, 8], None, reuse=True, held=[half]).cached == 2


def test_reuse_false_and_disabled_compute_everything() -> None:
    cache = cache_with(2, {0: [1, 2, 3]})
    assert cache.place(1, [1, 2, 3, 4], None, reuse=False).cached == 0
    off = PrefixCache(3, enabled=False)
    assert [off.place(1, [1, 2], None, reuse=True).slots[0] for _ in range(3)] == [0, 1, 2]
    off.release(1, [1, 2], None)
    off.release(0, [1, 2], None)
    again = off.place(1, [1, 2, 3], None, reuse=True)
    assert again.slots == [0] and again.cached == 0 and not off.entries
    assert off.hit_tokens == off.miss_tokens == 0


def test_clear_forgets_every_entry() -> None:
    cache = cache_with(2, {1: [1, 2, 3]})
    cache.clear()
    assert cache.place(1, [1, 2, 3, 4], None, reuse=True).cached == 0


def request_group(rid: str, prompt: list[int], n: int = 1, prompt_logprobs: int | None = None) -> Group:
    return Group.from_request(GenerationRequest(rid, prompt, SamplingParams(prompt_logprobs=prompt_logprobs), n=n))


def finish_all(s: Scheduler) -> None:
    for seq in list(s.running):
        seq.finish_reason = "stop"
        s.finish(seq)


def run_step(s: Scheduler) -> tuple[list[tuple[int, int, int]], list[tuple[str, int, int]]]:
    """Schedule a step; pretend its prefill ran; return the copies and (request, start, end) chunks."""
    step = s.schedule()
    chunks = [(c.group.request_id, c.start, c.end) for c in step.prefill]
    for c in step.prefill:
        s.prefilled(c)
        if c.last:
            for seq in c.group.seqs:
                seq.num_cached = c.group.prompt_len
    return step.copies, chunks


def test_scheduler_starts_prefill_after_the_cached_prefix() -> None:
    s = Scheduler(num_slots=2, chunk_size=64, cache_slots=1, prefix_cache=True)
    doc = list(range(100, 140))
    s.add(request_group("a", doc + [1, 2]))
    assert run_step(s) == ([], [("a", 0, 42)])
    for seq in s.running:
        seq.output_ids = [7]
        seq.num_cached = 43  # the generated token's K/V are written too
    finish_all(s)
    s.add(request_group("b", doc + [1, 2, 7, 3]))  # the next turn: extends the whole entry
    assert run_step(s) == ([], [("b", 43, 44)])
    assert s.groups["b"].cached_tokens == 43
    s.add(request_group("c", doc + [5]))  # while "b" runs: its prompt's first 40 tokens are copied
    copies, chunks = run_step(s)
    b_slot = s.groups["b"].seqs[0].slot
    c_group = s.groups["c"]
    assert copies == [(b_slot, c_group.prefill_slot, 40)] and chunks == [("c", 40, 41)]
    assert s.slots_used == 2  # the extra slot only caches: no third request runs


def test_scheduler_records_nothing_uncertain() -> None:
    s = Scheduler(num_slots=2, chunk_size=8, prefix_cache=True)
    prompt = list(range(1, 21))
    s.add(request_group("a", prompt, n=2))
    run_step(s)  # 8 of 20 prompt tokens into the prefill slot
    group = s.groups["a"]
    other = next(q for q in group.seqs if q.slot != group.prefill_slot)
    assert other.status is Status.PREFILL
    s.abort("a")
    assert s.prefix.entries[group.prefill_slot].tokens == prompt[:8]
    assert len(s.prefix.entries) == 1  # the second slot never received the prompt
    s.add(request_group("logprobs", prompt, prompt_logprobs=0))
    assert run_step(s)[1] == [("logprobs", 0, 8)]  # scoring the prompt recomputes it


def test_a_nearly_cached_prompt_does_not_narrow_the_others_chunks() -> None:
    s = Scheduler(num_slots=4, chunk_size=96, prefix_cache=True)
    doc = list(range(100, 130))
    s.add(request_group("first", doc + [1]))
    run_step(s)
    finish_all(s)
    s.add(request_group("cached", doc + [1, 2]))  # 31 of 32 tokens cached: one to compute
    for i in range(3):
        s.add(request_group(f"new{i}", [200 + i] * 20))
    assert run_step(s)[1] == [("cached", 31, 32), ("new0", 0, 20), ("new1", 0, 20), ("new2", 0, 20)]
    s.add(request_group("long", list(range(300, 400))))
    finish_all(s)
    s.add(request_group("short", [7] * 10))
    assert run_step(s)[1] == [("long", 0, 96)]  # the budget's width; the next prompt waits a step
    assert run_step(s)[1] == [("long", 96, 100), ("short", 0, 10)]


def test_the_next_copy_target_is_the_slot_a_copy_would_take_as_far_as_one_could_reach() -> None:
    s = Scheduler(num_slots=2, chunk_size=64, prefix_cache=True)
    assert s.next_copy_target() is None  # nothing computed yet: no copy could come
    doc = list(range(100, 140))
    s.add(request_group("a", doc + [1, 2]))
    step = s.schedule()  # admitted into slot 0, its 42-token prompt being computed
    assert s.next_copy_target() == (1, 42)
    s.prefilled(step.prefill[0])  # computed: decoding now
    for seq in s.running:
        seq.output_ids, seq.num_cached = [7] * 20, 62
    assert s.next_copy_target() == (1, 62)
    finish_all(s)  # slot 0 is an entry of 62 tokens, 40 of them the document: too few to take the slot
    s.add(request_group("b", doc + [9]))
    copies, _ = run_step(s)
    assert copies == [(0, s.groups["b"].prefill_slot, 40)] == [(0, 1, 40)]  # where the target said
    assert s.next_copy_target() == (0, 62)  # no empty slot left: the least recently used entry's
    s.add(request_group("c", [5, 6, 7]))
    run_step(s)
    assert s.next_copy_target() is None  # every running slot taken
    assert Scheduler(num_slots=2, chunk_size=64).next_copy_target() is None  # no prefix cache, no copies
