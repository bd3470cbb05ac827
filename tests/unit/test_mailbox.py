"""``runner.Mailbox``: one request's deltas, in order, for the one task reading them."""

from __future__ import annotations

import asyncio

import pytest

from trtserver.engine.base import SequenceOutput
from trtserver.engine.torch.runner import Mailbox


async def test_items_come_out_in_order_and_wake_the_reader() -> None:
    box = Mailbox()
    reader = asyncio.ensure_future(box.get())
    await asyncio.sleep(0)
    assert not reader.done()
    box.put(ValueError("first"))
    box.put(KeyError("second"))
    first = await reader
    assert isinstance(first, ValueError) and isinstance(await box.get(), KeyError)


async def test_a_cancelled_reader_leaves_the_box_usable() -> None:
    box = Mailbox()
    reader = asyncio.ensure_future(box.get())
    await asyncio.sleep(0)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    box.put(ValueError("later"))  # the cancelled waiter is skipped, not set
    assert isinstance(await asyncio.wait_for(box.get(), 1), ValueError)


def delta(token: int, finish: str | None = None) -> SequenceOutput:
    return SequenceOutput("r", 0, [token], finish_reason=finish)  # type: ignore[arg-type]


async def parked(box: Mailbox) -> asyncio.Future[object]:
    reader: asyncio.Future[object] = asyncio.ensure_future(box.get())
    await asyncio.sleep(0)
    assert not reader.done()
    return reader


async def test_a_sink_takes_deltas_only_while_the_reader_waits_with_nothing_queued() -> None:
    box = Mailbox()
    taken: list[int] = []
    box.sink = lambda d: taken.append(d.token_ids[0]) is None
    box.put(delta(1))  # nobody is waiting: queued, so the reader gets it first
    assert [d.token_ids for d in box.items] == [[1]] and taken == []
    first = await box.get()
    assert isinstance(first, SequenceOutput) and first.token_ids == [1]
    reader = await parked(box)
    box.put(delta(2))
    box.put(delta(3))
    assert taken == [2, 3] and not reader.done()
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    box.put(delta(4))  # the reader left: its waiter is done, so the delta is queued
    assert taken == [2, 3] and [d.token_ids for d in box.items] == [[4]]


async def test_what_the_sink_declines_and_errors_go_to_the_reader() -> None:
    box = Mailbox()
    box.sink = lambda d: d.finish_reason is None
    reader = await parked(box)
    box.put(delta(7, "length"))
    got = await reader
    assert isinstance(got, SequenceOutput) and got.finish_reason == "length"
    reader = await parked(box)
    box.put(ValueError("engine failed"))
    assert isinstance(await reader, ValueError)


async def test_end_wakes_the_reader_with_the_end_of_its_stream() -> None:
    box = Mailbox()
    box.sink = lambda d: True
    reader = await parked(box)
    box.end()
    assert await reader is None and box.sink is None
    box.put(delta(1))  # the engine had it on the way: dropped
    assert await box.get() is None and not box.items
