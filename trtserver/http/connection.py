"""One client connection, below the app: what aiohttp answers before any route runs.

A request aiohttp cannot parse (its request line, a header, Content-Length, a chunk size, a
Content-Encoding it cannot decode) is answered with the OpenAI JSON envelope, and logged by its
kind only: the bytes a client sent (a prompt, a key) never reach a log line. A request head that
has not fully arrived ``header_timeout_s`` after its first byte is answered 408 and closed, so a
client that sends headers byte by byte cannot hold a connection.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import structlog
from aiohttp import http_exceptions, web, web_protocol, web_request, web_server
from aiohttp.web_response import StreamResponse
from multidict import CIMultiDict, CIMultiDictProxy

from trtserver import errors
from trtserver.protocol import encoder

log = structlog.get_logger("trtserver.http.connection")
# seconds what a client still sends after a refusal is read (and dropped), so that it sees the answer
LINGERING_S = 2.0

# what a client is told about a request aiohttp could not parse, by kind (its message may quote the bytes)
_DESCRIPTIONS: tuple[tuple[type[BaseException], str], ...] = (
    (http_exceptions.ContentLengthError, "the body does not match its Content-Length"),
    (http_exceptions.TransferEncodingError, "the chunked body is malformed"),
    (http_exceptions.ContentEncodingError, "the body cannot be decoded with its Content-Encoding"),
    (http_exceptions.DecompressSizeError, "the body decompresses to more than the server accepts"),
    (http_exceptions.LineTooLong, "a request line or header is too long"),
    (http_exceptions.InvalidHeader, "a header is malformed"),
    (http_exceptions.BadHttpMethod, "the request method is malformed"),
    (http_exceptions.BadStatusLine, "the request line is malformed"),
    (http_exceptions.InvalidURLError, "the request URL is malformed"),
)


def parse_error(status: int, exc: BaseException | None) -> errors.APIError:
    """The client-facing error for a request aiohttp refused while parsing it."""
    if isinstance(exc, http_exceptions.ContentEncodingError) and "brotli" in str(exc).lower():
        return errors.UnsupportedMediaType("Content-Encoding br is not supported by this server; "
                                           "send the body uncompressed, or with gzip or deflate",
                                           code="unsupported_content_encoding")
    if status >= 500:
        return errors.EngineError("The server had an error while processing your request.")
    if isinstance(exc, http_exceptions.BadHttpMessage) and "too many headers" in str(exc).lower():
        return errors.InvalidRequest("Malformed HTTP request: too many headers")
    reason = next((text for kind, text in _DESCRIPTIONS if isinstance(exc, kind)),
                  "its request line, headers or framing are malformed")
    return errors.InvalidRequest(f"Malformed HTTP request: {reason}")


def envelope_response(error: errors.APIError, request_id: str) -> web.Response:
    response = web.Response(body=encoder.encode(error.envelope()), status=error.status,
                            content_type="application/json", headers=error.headers or None)
    response.headers["X-Request-Id"] = request_id
    return response


class GuardedRequestHandler(web_protocol.RequestHandler):
    """aiohttp's protocol with the envelope for its own errors and a deadline for request heads."""

    def __init__(self, manager: web_server.Server, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._lingering = False

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # answered and half-closed: what still comes is dropped
            return
        super().data_received(data)
        if self._messages or self._request_in_progress:
            self._stop_head_timer()
        elif self._head_timer is None and not (self._force_close or self._close):
            self._head_timer = self._loop.call_later(self._header_timeout_s, self._head_timed_out)

    async def _handle_request(self, request: web_request.BaseRequest, start_time: float | None,
                              request_handler: Any) -> tuple[StreamResponse, bool]:
        self._stop_head_timer()
        return await super()._handle_request(request, start_time, request_handler)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def log_exception(self, *args: Any, **kwargs: Any) -> None:
        """aiohttp's own failures (e.g. reading the rest of a body that failed to decode) by kind only:
        their messages and tracebacks may quote what the client sent."""
        exc = kwargs.get("exc_info")
        what = args[0] if args and isinstance(args[0], str) else None
        log.warning("http_connection_error", what=what,
                    error=type(exc).__name__ if isinstance(exc, BaseException) else None)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        transport = self.transport
        if self._request_in_progress or self._messages or transport is None or transport.is_closing():
            return
        log.info("request_head_timeout", timeout_s=self._header_timeout_s)
        error = errors.RequestReadTimeout(f"the request headers did not arrive within {self._header_timeout_s} s")
        body = encoder.encode(error.envelope())
        head = ("HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nX-Request-Id: {uuid.uuid4().hex}\r\nConnection: close\r\n\r\n")
        transport.write(head.encode() + body)
        if not transport.can_write_eof():
            self.force_close()
            return
        # a half-close, then reads dropped for a moment: closing at once would answer the bytes a slow client
        # is still sending with a reset, which can discard the 408 before the client has read it
        transport.write_eof()
        self._lingering = True
        self._loop.call_later(LINGERING_S, self.force_close)

    def handle_error(self, request: web_request.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> StreamResponse:
        error = parse_error(status, exc)
        if error.status >= 500:
            log.error("http_internal_error", error=type(exc).__name__ if exc is not None else None)
        else:
            log.info("http_request_refused", status=error.status, error=type(exc).__name__ if exc else None)
        if request.writer.output_size > 0:  # a response already started: nothing more can be said on it
            raise ConnectionError("the response was already under way")
        response = envelope_response(error, uuid.uuid4().hex)
        response.force_close()
        return response


# on a request whose ``Expect`` is not ``100-continue``: its value, for the app's middleware to refuse
UNMET_EXPECTATION = web.RequestKey("trtserver_unmet_expectation", str)


class GuardedServer(web_server.Server):
    """aiohttp's protocol factory, making ``GuardedRequestHandler`` connections.

    An ``Expect`` other than ``100-continue`` is taken off the request and noted under
    ``UNMET_EXPECTATION``, so the app's middleware answers it (aiohttp would answer it itself,
    before any middleware, in plain text)."""

    def __init__(self, base: web_server.Server, *, header_timeout_s: float) -> None:
        self._base_factory = base.request_factory
        super().__init__(base.request_handler, request_factory=self._make_guarded_request,
                         handler_cancellation=base.handler_cancellation, **base._kwargs)
        self._header_timeout_s = header_timeout_s

    def _make_guarded_request(self, message: Any, payload: Any, protocol: Any, writer: Any,
                              task: Any) -> web_request.BaseRequest:
        expect = message.headers.get("Expect")
        if expect is None or expect.lower() == "100-continue":
            return self._base_factory(message, payload, protocol, writer, task)
        headers = CIMultiDictProxy(CIMultiDict((k, v) for k, v in message.headers.items() if k.lower() != "expect"))
        request = self._base_factory(message._replace(headers=headers), payload, protocol, writer, task)
        if isinstance(request, web.Request):
            request[UNMET_EXPECTATION] = expect
        return request

    def __call__(self) -> web_protocol.RequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, header_timeout_s=self._header_timeout_s, **self._kwargs)


class GuardedAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections are ``GuardedRequestHandler``s."""

    def __init__(self, app: web.Application, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout_s = header_timeout_s

    async def _make_server(self) -> web_server.Server:
        return GuardedServer(await super()._make_server(), header_timeout_s=self._header_timeout_s)
