"""The torch-free scheduler: admission order, slot accounting, abort, chunked prefill."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trtserver.engine.base import GenerationRequest, Priority, SamplingParams
from trtserver.engine.torch.scheduler import Scheduler
from trtserver.engine.torch.sequence import Group, Status


def group(rid: str, prompt_len: int = 4, n: int = 1, priority: Priority = Priority.NORMAL) -> Group:
    return Group.from_request(GenerationRequest(rid, list(range(1, prompt_len + 1)), SamplingParams(), n=n,
                                                priority=priority))


def run_prefill(s: Scheduler) -> list[str]:
    """Schedule one step and pretend its prefill chunks ran; return the groups prefilled."""
    step = s.schedule()
    for chunk in step.prefill:
        s.prefilled(chunk)
    return [c.group.request_id for c in step.prefill]


def test_scheduler_imports_no_torch() -> None:
    code = "import sys, trtserver.engine.torch.scheduler; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_admission_by_priority_then_arrival() -> None:
    s = Scheduler(num_slots=1, chunk_size=64)
    for g in (group("low", priority=Priority.LOW), group("a"), group("high", priority=Priority.HIGH), group("b")):
        s.add(g)
    order = []
    for _ in range(4):
        order += run_prefill(s)
        for seq in list(s.running):
            seq.finish_reason = "length"
            s.finish(seq)
    assert order == ["high", "a", "b", "low"]


def test_slots_are_held_until_finish_and_head_is_not_skipped() -> None:
    s = Scheduler(num_slots=3, chunk_size=64)
    s.add(group("two", n=2))
    s.add(group("wide", n=3))
    s.add(group("one"))
    assert run_prefill(s) == ["two"]  # "wide" does not fit; "one" waits behind it
    assert s.slots_used == 2 and s.num_waiting == 2
    assert {q.slot for q in s.running} == {0, 1}
    for seq in list(s.running):
        seq.finish_reason = "stop"
        s.finish(seq)
    assert s.slots_used == 0
    assert run_prefill(s) == ["wide"]
    assert s.slots_used == 3


def test_n_larger_than_slots_is_refused() -> None:
    with pytest.raises(ValueError, match="slots"):
        Scheduler(num_slots=2, chunk_size=64).add(group("x", n=3))


def test_abort_frees_slots_in_every_state() -> None:
    s = Scheduler(num_slots=2, chunk_size=4)
    s.add(group("running"))
    s.add(group("prefilling", prompt_len=10))
    s.add(group("waiting"))
    run_prefill(s)  # "running" done (4 tokens), "prefilling" not yet scheduled (budget used)
    assert s.slots_used == 2
    for rid in ("running", "prefilling", "waiting"):
        stopped = s.abort(rid)
        assert stopped and all(q.finish_reason == "abort" and q.status is Status.FINISHED for q in stopped)
    assert s.slots_used == 0 and not s.has_work
    assert s.abort("running") == []  # twice, or late: harmless


def test_abort_one_sequence_keeps_the_others() -> None:
    s = Scheduler(num_slots=4, chunk_size=64)
    g = group("g", n=3)
    s.add(g)
    run_prefill(s)
    assert [q.index for q in s.abort("g", 1)] == [1]
    assert s.slots_used == 2 and len(s.running) == 2


def test_abort_of_the_prefill_slot_owner_hands_the_slot_over() -> None:
    s = Scheduler(num_slots=4, chunk_size=4)
    g = group("g", prompt_len=10, n=2)
    s.add(g)
    s.prefilled(s.schedule().prefill[0])  # 4 of 10 tokens into g.prefill_slot (sequence 0's)
    s.abort("g", 0)
    assert g.seqs[1].slot == g.prefill_slot  # the survivor now owns the half-written slot
    assert s.slots_used == 1


def test_chunked_prefill_interleaves_with_decode() -> None:
    s = Scheduler(num_slots=4, chunk_size=8)
    s.add(group("short", prompt_len=3))
    assert run_prefill(s) == ["short"]
    s.add(group("long", prompt_len=20))
    chunks = []
    for _ in range(3):
        step = s.schedule()
        assert [q.group.request_id for q in step.decode] == ["short"]  # decode runs every step
        chunks += [(c.start, c.end) for c in step.prefill]
        for c in step.prefill:
            s.prefilled(c)
    assert chunks == [(0, 8), (8, 16), (16, 20)]
    assert len(s.running) == 2


def test_short_prompts_share_one_prefill_chunk() -> None:
    s = Scheduler(num_slots=8, chunk_size=64)
    for i in range(5):
        s.add(group(f"p{i}", prompt_len=10))
    step = s.schedule()
    assert [c.group.request_id for c in step.prefill] == [f"p{i}" for i in range(5)]
    assert all((c.start, c.end) == (0, 10) for c in step.prefill)
    # padded cost (rows x longest chunk) stays within the budget
    s2 = Scheduler(num_slots=8, chunk_size=32)
    for i in range(5):
        s2.add(group(f"p{i}", prompt_len=10))
    assert len(s2.schedule().prefill) == 3


def test_duplicate_request_id_is_refused() -> None:
    s = Scheduler(num_slots=2, chunk_size=8)
    s.add(group("x"))
    with pytest.raises(ValueError, match="already"):
        s.add(group("x"))


def test_a_sequence_aborted_while_waiting_leaves_the_prefill_to_the_others() -> None:
    s = Scheduler(num_slots=4, chunk_size=64)
    g = group("wide", n=3)
    s.add(g)
    assert [q.index for q in s.abort("wide", 0)] == [0]
    assert run_prefill(s) == ["wide"]
    assert g.prefill_slot >= 0 and g.prefill_slot in {q.slot for q in g.seqs[1:]}
    assert g.seqs[0].slot == -1 and s.slots_used == 2
    assert {q.index for q in s.running} == {1, 2}
