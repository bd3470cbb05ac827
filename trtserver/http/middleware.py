"""The middleware every request passes: its id, the API key, and the one mapping of errors to the
OpenAI envelope (also for refusals aiohttp makes itself, and for requests cut off at shutdown)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web

from trtserver import errors
from trtserver.http.connection import UNMET_EXPECTATION
from trtserver.http.sse import end_stream_with_error
from trtserver.http.state import EVENT_STREAM, MAX_REQUEST_ID_CHARS, REQUEST_ID, STATE
from trtserver.protocol import (
    encoder,
)
from trtserver.quota import refund_counts, track_counts
from trtserver.serving import new_request_id

log = structlog.get_logger("trtserver.http.middleware")


def json_response(payload: object, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=encoder.encode(payload), status=status, content_type="application/json",
                        headers=headers)


def error_response(exc: errors.APIError) -> web.Response:
    return json_response(exc.envelope(), status=exc.status, headers=exc.headers or None)


def valid_request_id(value: str) -> bool:
    """Request ids travel in a response header: 1 to 256 printable ASCII characters."""
    return 0 < len(value) <= MAX_REQUEST_ID_CHARS and value.isascii() and value.isprintable()


@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    state = request.app[STATE]
    given_id = request.headers.get("X-Request-Id")
    refused_id = given_id is not None and not valid_request_id(given_id)
    request_id = given_id if given_id is not None and not refused_id else new_request_id()
    request[REQUEST_ID] = request_id
    structlog.contextvars.bind_contextvars(request_id=request_id)
    task = asyncio.current_task()
    if task is not None:
        state.handling[task] = request
    track_counts()
    try:
        if refused_id:
            raise errors.InvalidRequest(f"X-Request-Id must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII "
                                        "characters", param="X-Request-Id")
        if UNMET_EXPECTATION in request:
            raise errors.ExpectationFailed("Expect: only 100-continue is supported", param="Expect")
        _authenticate(request)
        return await handler(request)
    except errors.APIError as exc:
        log.info("request_failed", status=exc.status, error=exc.message, param=exc.param)
        if exc.status == 400:  # refused as invalid: it costs its project no request
            await refund_counts()
        _count_failure(request, exc.status)
        response = error_response(exc)
        if isinstance(exc, errors.RequestReadTimeout):
            response.force_close()  # the rest of a body that came too slowly is not waited for
        return response
    except web.HTTPRequestEntityTooLarge:
        limit = state.config.max_body_bytes
        return error_response(errors.PayloadTooLarge(f"Request body is larger than {limit} bytes"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(_route_error(request, exc))
    except asyncio.CancelledError:
        if not state.cut_off:
            log.info("client_disconnected")
            raise
        return await _cut_off(request)
    except Exception:
        log.exception("internal_error")
        _count_failure(request, 500)
        return error_response(errors.EngineError("The server had an error while processing your request."))
    finally:
        if task is not None:
            state.handling.pop(task, None)
        structlog.contextvars.unbind_contextvars("request_id", "user")


def _route_error(request: web.Request, exc: web.HTTPException) -> errors.APIError:
    """aiohttp's own refusals (no such route, wrong method) as the envelope; a 405 keeps its Allow header."""
    if exc.status == 404:
        return errors.NotFound(f"No route {request.method} {request.path}", code="not_found")
    headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
    wrapped = errors.APIError(exc.reason or "error", code="method_not_allowed" if exc.status == 405 else None,
                              headers=headers)
    wrapped.status = exc.status
    wrapped.type = "invalid_request_error"
    return wrapped


async def _cut_off(request: web.Request) -> web.StreamResponse:
    """A request still running when the shutdown grace period ended: a stream gets an error event and
    ``[DONE]``, anything else a 503."""
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):  # 3.11+: this task goes on to answer
        task.uncancel()
    log.warning("request_cut_off_at_shutdown")
    error = errors.Overloaded("The server shut down before the request finished", code="server_shutdown")
    stream = request.get(EVENT_STREAM)
    if stream is None:
        return error_response(error)
    with contextlib.suppress(ConnectionError, RuntimeError):
        await end_stream_with_error(stream, error)
    return stream


async def end_requests(app: web.Application, wait_s: float = 2.0) -> None:
    """Cut off every request still being handled (see ``_cut_off``) and wait up to ``wait_s`` for them."""
    state = app[STATE]
    state.cut_off = True
    tasks = [task for task in state.handling if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=wait_s)


async def on_response_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Every response names its request (``X-Request-Id``); a stream is noted for a cut-off."""
    response.headers["X-Request-Id"] = request.get(REQUEST_ID) or new_request_id()
    if response.content_type == "text/event-stream":
        request[EVENT_STREAM] = response


def bearer_token(request: web.Request) -> str | None:
    """The key in ``Authorization: Bearer <key>``; None without one."""
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() != "bearer ":
        return None
    return auth[7:].strip() or None


def _key_matches(given: str | None, keys: list[str]) -> bool:
    # compare against every key so the time taken does not reveal which prefix matched
    sent = (given or "").encode("utf-8", "surrogateescape")  # header bytes aiohttp could not decode stay bytes
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(sent, key.encode())
    return matched and given is not None


def _authenticate(request: web.Request) -> None:
    """With ``api_keys`` configured, every route but health and metrics needs one of them; /metrics
    needs a metrics key (``metrics_api_keys``) or, with ``metrics_need_api_key``, any key."""
    config = request.app[STATE].config
    api_keys = config.api_keys + config.no_limit_api_keys
    if request.path == "/metrics":
        if request.match_info.http_exception is not None:  # served on the metrics_port listener: a 404 here
            return
        if not (config.metrics_api_keys or config.metrics_need_api_key):
            return
        keys = config.metrics_api_keys + (api_keys if config.metrics_need_api_key else [])
    elif not api_keys or request.path in request.app[STATE].open_paths:
        return
    else:
        keys = api_keys
    if not _key_matches(bearer_token(request), keys):
        raise errors.AuthenticationError("Incorrect or missing API key; send it as 'Authorization: Bearer <key>'",
                                         headers={"WWW-Authenticate": "Bearer"})


GENERATION_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def _count_failure(request: web.Request, status: int) -> None:
    metrics = request.app[STATE].metrics
    endpoint = GENERATION_ENDPOINTS.get(request.path)
    if metrics is not None and endpoint is not None:
        metrics.requests.labels(status=str(status), tier="none", endpoint=endpoint).inc()


