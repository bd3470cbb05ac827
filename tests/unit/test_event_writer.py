"""``sse.EventWriter``: the first event through aiohttp (it carries the headers), then straight to the transport."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trtserver.http.sse import EventWriter


class Transport:
    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.buffered = 0
        self.closing = False

    def write(self, data: bytes) -> None:
        self.sent.append(data)

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return self.closing


class Writer:
    def __init__(self) -> None:
        self.drains = 0

    async def drain(self) -> None:
        self.drains += 1


def make(encoding: str, *, compression: bool = False) -> tuple[EventWriter, Transport, Writer, list[bytes]]:
    transport, writer, through_aiohttp = Transport(), Writer(), []

    async def write(data: bytes) -> None:
        through_aiohttp.append(data)

    response = SimpleNamespace(headers={"Transfer-Encoding": encoding} if encoding else {}, compression=compression,
                               write=write)
    events = EventWriter(SimpleNamespace(transport=transport), response, writer)  # type: ignore[arg-type]
    return events, transport, writer, through_aiohttp


async def test_chunked_framing_after_the_first_event() -> None:
    events, transport, _, through_aiohttp = make("chunked")
    for event in (b"data: 1\n\n", b"data: 22\n\n", b"data: [DONE]\n\n"):
        await events.send(event)
    assert through_aiohttp == [b"data: 1\n\n"]
    assert transport.sent == [b"a\r\ndata: 22\n\n\r\n", b"e\r\ndata: [DONE]\n\n\r\n"]


async def test_unframed_for_http_1_0() -> None:
    events, transport, _, _ = make("")
    await events.send(b"data: 1\n\n")
    await events.send(b"data: 2\n\n")
    assert transport.sent == [b"data: 2\n\n"]


async def test_compressed_responses_stay_with_aiohttp() -> None:
    events, transport, _, through_aiohttp = make("chunked", compression=True)
    await events.send(b"data: 1\n\n")
    await events.send(b"data: 2\n\n")
    assert transport.sent == [] and len(through_aiohttp) == 2


async def test_a_slow_reader_is_waited_for() -> None:
    events, transport, writer, _ = make("chunked")
    await events.send(b"data: 1\n\n")
    await events.send(b"data: 2\n\n")
    assert writer.drains == 0
    transport.buffered = 1 << 20  # the kernel took only part: aiohttp's protocol decides how long to wait
    await events.send(b"data: 3\n\n")
    assert writer.drains == 1


async def test_a_closed_connection_raises() -> None:
    events, transport, _, _ = make("chunked")
    await events.send(b"data: 1\n\n")
    transport.closing = True
    with pytest.raises(ConnectionResetError):
        await events.send(b"data: 2\n\n")
