"""Writing a response as Server-Sent Events, and the per-request deadline for both response kinds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import structlog
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from trtserver import errors
from trtserver.protocol import encoder
from trtserver.serving import Api, Prepared, Service

log = structlog.get_logger("trtserver.http.sse")
T = TypeVar("T")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _timeout(timeout_s: float | None) -> errors.RequestTimeout:
    return errors.RequestTimeout(f"the request took longer than {timeout_s} s")


async def with_timeout(coro: Awaitable[T], timeout_s: float | None) -> T:
    if timeout_s is None:
        return await coro
    try:
        return await asyncio.wait_for(coro, timeout_s)
    except asyncio.TimeoutError as exc:  # an alias of TimeoutError from 3.11; distinct on 3.10
        raise _timeout(timeout_s) from exc


class Deadline:
    """``--request-timeout-s`` for a stream: each chunk must come before the request's deadline."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.at = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s

    def next(self, chunks: AsyncIterator[T]) -> Awaitable[T | None]:
        """The next chunk, None at the end. Without a timeout this is ``anext`` itself: no frame
        of ours between the response and the chunks, once per token."""
        if self.at is None:
            return anext(chunks, None)
        return self._before_deadline(chunks, self.at)

    async def _before_deadline(self, chunks: AsyncIterator[T], at: float) -> T | None:
        try:
            return await asyncio.wait_for(anext(chunks, None), max(at - asyncio.get_running_loop().time(), 0))
        except asyncio.TimeoutError as exc:
            raise _timeout(self.timeout_s) from exc


def _event(payload: object) -> bytes:
    return b"data: " + encoder.encode(payload) + b"\n\n"


class EventWriter:
    """Puts a prepared stream's events on its socket: straight onto the transport, framed for
    chunked transfer-encoding when the response is chunked (HTTP/1.1). This runs once per streamed
    token, and aiohttp's ``StreamResponse.write`` takes five Python calls to do the same; it is
    still used for the first event (it carries the buffered headers) and for the end."""

    def __init__(self, request: web.Request, response: web.StreamResponse,
                 writer: AbstractStreamWriter | None) -> None:
        self._transport = request.transport
        self._response = response
        self._writer = writer
        encoding = response.headers.get("Transfer-Encoding", "")  # as prepared for the wire
        self._chunked = encoding == "chunked"
        self._direct = writer is not None and not response.compression and encoding in ("", "chunked")
        self._headers_sent = False

    async def send(self, event: bytes) -> None:
        if not self._headers_sent or not self._direct:
            self._headers_sent = True
            await self._response.write(event)
            return
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client went away")
        self._put(transport, event)
        if transport.get_write_buffer_size() and self._writer is not None:  # a slow reader: wait while
            await self._writer.drain()  # aiohttp's protocol says the buffer is full

    @property
    def direct(self) -> bool:
        """Events after the first go straight to the transport (not compressed, plain or chunked)."""
        return self._direct

    def _put(self, transport: asyncio.Transport, event: bytes) -> None:
        transport.write(b"%x\r\n%b\r\n" % (len(event), event) if self._chunked else event)


async def stream_response(request: web.Request, service: Service, api: Api[Any], prepared: Prepared[Any],
                          timeout_s: float | None) -> web.StreamResponse:
    chunks = service.stream(api, prepared)
    # what trtserver_response_ready sees, joined only where a plugin implements it (a cost per token)
    joiner = api.joiner(prepared, service) if service.wants_response_ready() else None
    deadline = Deadline(timeout_s)
    # the first chunk is produced before the headers go out, so early errors are plain 4xx/5xx
    chunk = await deadline.next(chunks)
    response = web.StreamResponse(headers={**SSE_HEADERS, **prepared.context.response_headers})
    events = EventWriter(request, response, await response.prepare(request))
    try:
        while chunk is not None:
            await events.send(_event(chunk))
            if joiner is not None:
                joiner.add(chunk)
            chunk = await deadline.next(chunks)
    except errors.APIError as exc:
        await response.write(_event(exc.envelope()))
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception:
        log.exception("stream_failed")
        await response.write(_event(errors.EngineError("The server had an error while streaming the response.")
                                    .envelope()))
    else:
        if joiner is not None:
            await service.response_ready(prepared, joiner.response())
    finally:
        await chunks.aclose()
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def end_stream_with_error(response: web.StreamResponse, error: errors.APIError) -> None:
    """End a stream whose headers are out from outside its writer (the server is shutting down):
    an error event, ``[DONE]``, the end of the body."""
    await response.write(_event(error.envelope()))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
