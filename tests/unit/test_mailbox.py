"""``runner.Mailbox``: one request's deltas, in order, for the one task reading them."""

from __future__ import annotations

import asyncio

import pytest

from trtserver.engine.torch.transport.thread import Mailbox


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
