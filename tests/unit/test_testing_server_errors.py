"""Servers made by ``trtserver.testing`` answer aiohttp's own protocol errors with the JSON envelope, as
``trtserver serve`` does: a plugin author's test sees what a client of the real server would."""

from __future__ import annotations

import asyncio
import json

import pytest

from trtserver.testing import serve_scripted

BODY = b'{"prompt": "Hi", "max_tokens": 2}'


async def exchange(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """``data`` on a fresh connection; the status, headers and body of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


def request(head_extra: bytes, body: bytes) -> bytes:
    return b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + head_extra + \
        b"Connection: close\r\n\r\n" + body


@pytest.mark.parametrize(("name", "data"), [
    ("bad chunk size", request(b"Transfer-Encoding: chunked\r\n", b"zz\r\n" + BODY + b"\r\n0\r\n\r\n")),
    ("bad Content-Length", request(b"Content-Length: twelve\r\n", BODY)),
    ("too many headers", request(b"".join(b"X-H%d: v\r\n" % i for i in range(200)), BODY)),
])
async def test_protocol_errors_are_the_json_envelope(name: str, data: bytes) -> None:
    async with serve_scripted() as client:
        assert client.port is not None
        status, headers, body = await exchange(client.port, data)
        assert status == 400, (name, status, body[:200])
        assert headers["content-type"].startswith("application/json"), (name, headers)
        error = json.loads(body)["error"]
        assert error["type"] == "invalid_request_error" and error["message"], (name, error)
        # the server still serves well-formed requests afterwards
        good = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert good.status == 200


async def test_a_head_sent_too_slowly_is_answered_408_in_the_envelope() -> None:
    async with serve_scripted(header_timeout_s=0.5) as client:
        assert client.port is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHo")  # and nothing more
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.split()[1] == b"408", raw[:200]
        assert json.loads(body)["error"]["message"]


async def test_the_408_survives_a_client_that_keeps_sending_before_it_reads() -> None:
    """The server answers a late head, half-closes and reads on a moment: bytes the client still sends
    must not reset the connection before it has read the answer."""
    async with serve_scripted(header_timeout_s=0.3) as client:
        assert client.port is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHo")
        await writer.drain()
        await asyncio.sleep(0.6)  # the deadline has passed: the 408 is on its way
        for byte in b"st: x\r\n":  # a slow client still sending its head, byte by byte
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.05)
        raw = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.split()[1] == b"408", raw[:200]
        assert json.loads(body)["error"]["message"]
