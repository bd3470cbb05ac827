"""The soak's careless and hostile requests (``bench.soak --abusers``): each sent on its own, bounded
in time, and checked for the answer a well-behaved server gives it (its 4xx JSON envelope)."""

from __future__ import annotations

import asyncio
import itertools
import json
import re

import aiohttp


class Malformed(Exception):
    """An answer that is not what the request should get."""


ABUSE_KINDS = ("deep_json", "bad_gzip", "bad_request_id", "bad_chunk", "slow_head", "cut_body", "slow_reader",
               "slow_guide")
_guides = itertools.count(1000)
HEAD_TIMEOUT_S, BODY_TIMEOUT_S = 2.0, 3.0  # the server's --header-timeout-s / --body-timeout-s here


async def _raw(port: int, data: bytes, *, pause_s: float = 0.0, pieces: int = 1) -> bytes:
    """``data`` over a fresh socket (in ``pieces``, ``pause_s`` apart), read meanwhile; what the server
    sent until it closed (it may close before everything was sent: a deadline or a refusal)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def send() -> None:
        size = max(1, -(-len(data) // pieces))
        for start in range(0, len(data), size):
            writer.write(data[start:start + size])
            await writer.drain()
            if pause_s:
                await asyncio.sleep(pause_s)

    sender = asyncio.create_task(send())
    try:
        return await asyncio.wait_for(reader.read(-1), HEAD_TIMEOUT_S + BODY_TIMEOUT_S + 15)
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)  # a reset while sending is the server closing
        writer.close()


def _request(body: bytes, headers: str = "", length: int | None = None) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n{headers}\r\n").encode() + body


def _expect_envelope(reply: bytes, status: int) -> None:
    head, _, body = reply.partition(b"\r\n\r\n")
    if not (head.startswith(b"HTTP/1.") and head[9:13] == b"%d " % status):
        raise Malformed(f"expected {status}, got {head[:60]!r}")
    if b"application/json" not in head or b"x-request-id" not in head.lower() or b'"error"' not in body:
        raise Malformed(f"not the JSON envelope: {reply[:300]!r}")


async def abuse(kind: str, http: aiohttp.ClientSession, base: str, port: int) -> None:
    ok = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    if kind == "deep_json":
        _expect_envelope(await _raw(port, _request(b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}")), 400)
    elif kind == "bad_gzip":
        _expect_envelope(await _raw(port, _request(ok, "Content-Encoding: gzip\r\n")), 400)
    elif kind == "bad_request_id":
        _expect_envelope(await _raw(port, _request(ok, "X-Request-Id: caf\u00e9\r\n")), 400)
    elif kind == "bad_chunk":
        head = _request(b"", "Transfer-Encoding: chunked\r\n").replace(b"Content-Length: 0\r\n", b"")
        _expect_envelope(await _raw(port, head + b"zz\r\n" + ok + b"\r\n0\r\n\r\n"), 400)
    elif kind == "slow_head":  # one byte every 0.25 s: the server answers 408 once the head is too late
        _expect_envelope(await _raw(port, _request(ok)[:40], pause_s=0.25, pieces=40), 408)
    elif kind == "cut_body":  # a head promising more body than ever comes: 408 after the body deadline
        _expect_envelope(await _raw(port, _request(ok[:5], length=len(ok))), 408)
    elif kind == "slow_guide":  # a guide that takes seconds to compile, new each time: compiled off the step loop
        bound = next(_guides)
        body = {"prompt": "Name:", "max_tokens": 6, "guided_regex": f"[a-z ]{{1,{bound}}}"}
        async with http.post(f"{base}/v1/completions", json=body) as response:
            answer = await response.json()
        if response.status == 200:
            text = answer["choices"][0]["text"]
            if not re.fullmatch(r"[a-z ]*", text):
                raise Malformed(f"guided text outside its regex: {text!r}")
        elif response.status != 400 or "error" not in answer:  # 400: the compile time-out, in the envelope
            raise Malformed(f"slow guide: HTTP {response.status} {str(answer)[:200]}")
    elif kind == "slow_reader":  # reads a stream a line at a time with pauses; the whole stream still arrives
        body = {"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True, "stream": True}
        async with http.post(f"{base}/v1/completions", json=body) as response:
            if response.status != 200:
                raise Malformed(f"HTTP {response.status}")
            last = b""
            async for line in response.content:
                if line.strip():
                    last = line.strip()
                    await asyncio.sleep(0.05)
            if last != b"data: [DONE]":
                raise Malformed(f"slow reader's stream ended with {last[:100]!r}")
