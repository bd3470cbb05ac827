"""The aiohttp application: routes, SSE, the one error mapping, engine lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import numpy as np
import pluggy
import structlog
from aiohttp import web, web_protocol
from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD
from prometheus_client import CONTENT_TYPE_LATEST

from trtserver import __version__, errors
from trtserver.config import ServerConfig
from trtserver.engine.base import Engine
from trtserver.engine.select import build_engine
from trtserver.http.connection import UNMET_EXPECTATION
from trtserver.http.metrics import Metrics
from trtserver.http.openapi import openapi_document
from trtserver.http.sse import end_stream_with_error, stream_response, with_timeout
from trtserver.plugins import allowlist_from_env, await_me_maybe, load_plugins, new_plugin_manager
from trtserver.protocol import (
    CHAT_REQUEST_FIELDS,
    REQUEST_FIELDS,
    DetokenizeRequest,
    FieldError,
    GenerationFields,
    ModelCard,
    ModelList,
    TokenizeRequest,
    chat_request_decoder,
    encoder,
    request_decoder,
)
from trtserver.quota import refund_counts, track_counts
from trtserver.request_context import RequestContext
from trtserver.serving import Api, Prepared, Service, new_request_id, tokens
from trtserver.serving.chat import ChatApi
from trtserver.serving.completions import CompletionsApi

log = structlog.get_logger("trtserver.http.app")



@dataclass(slots=True)
class ServerState:
    """What the running app holds; one per app, under ``STATE``."""

    config: ServerConfig
    pm: pluggy.PluginManager
    engine: Engine | None = None
    service: Service | None = None
    ready: bool = False
    load_error: str | None = None
    draining: bool = False
    started_at: float = field(default_factory=time.time)
    in_flight: int = 0
    engine_task: asyncio.Task[None] | None = None
    metrics: Metrics | None = None
    # `trtserver serve` sets it (to pin the event loop): what runs once the engine has started
    engine_started: Callable[[Engine], None] | None = None
    # paths answered without an API key; a plugin serving a web page adds its own (its API calls carry the key)
    open_paths: set[str] = field(default_factory=lambda: set(OPEN_PATHS))
    # every request being handled, by the task that handles it (``end_requests`` cuts them off)
    handling: dict[asyncio.Task[object], web.Request] = field(default_factory=dict)
    cut_off: bool = False


STATE = web.AppKey("trtserver_state", ServerState)
REQUEST_ID = web.RequestKey("trtserver_request_id", str)
# an SSE response once its headers are out (what a cut-off request's last events go on)
EVENT_STREAM = web.RequestKey("trtserver_event_stream", web.StreamResponse)
MAX_REQUEST_ID_CHARS = 256


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


async def _on_response_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Every response names its request (``X-Request-Id``); a stream is noted for a cut-off."""
    response.headers["X-Request-Id"] = request.get(REQUEST_ID) or new_request_id()
    if response.content_type == "text/event-stream":
        request[EVENT_STREAM] = response


OPEN_PATHS: frozenset[str] = frozenset({"/health", "/metrics"})


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


def _state(request: web.Request) -> ServerState:
    return request.app[STATE]


def _service(request: web.Request) -> Service:
    state = _state(request)
    if state.draining:
        raise errors.Overloaded("The server is shutting down", headers={"Retry-After": "1"})
    if not state.ready or state.service is None:
        raise errors.Overloaded("The model is still loading", code="model_loading", headers={"Retry-After": "2"})
    return state.service


RequestT = TypeVar("RequestT", bound=msgspec.Struct)


async def decode_request(request: web.Request, decoder: msgspec.json.Decoder[RequestT],
                         known: frozenset[str] = REQUEST_FIELDS) -> tuple[RequestT, dict[str, object]]:
    """Body -> the API's request Struct; unknown fields are returned (and logged), ``extra_body`` merged."""
    content_type = request.headers.get("Content-Type", "application/json")
    if not (content_type.startswith("application/json") or "+json" in content_type):
        raise errors.UnsupportedMediaType(f"Unsupported Media Type: expected application/json, got {content_type}")
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in BODY_ENCODINGS:
        raise errors.UnsupportedMediaType(f"Unsupported Content-Encoding: expected one of {', '.join(BODY_ENCODINGS)}",
                                          code="unsupported_content_encoding")
    config = request.app[STATE].config
    body = await _read_body(request, config.body_timeout_s)
    depth = json_depth(body)
    if depth > config.max_json_depth:
        raise errors.InvalidRequest(f"Request body is nested {depth} levels deep; at most {config.max_json_depth} "
                                    "are accepted", param=None, code="json_too_deep")
    try:
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError as exc:
        raise errors.InvalidRequest("Request body must be a JSON object", param=None) from exc
    except msgspec.DecodeError as exc:
        raise errors.from_validation_error(exc) from exc
    if "extra_body" in fields:
        try:
            extra = msgspec.json.decode(fields["extra_body"], type=dict[str, msgspec.Raw] | None)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise errors.InvalidRequest("extra_body must be an object", param="extra_body") from exc
        for key, value in (extra or {}).items():
            fields.setdefault(key, value)
        body = msgspec.json.encode(fields)
    unknown = {key: msgspec.json.decode(value) for key, value in fields.items() if key not in known}
    if unknown:
        # names only, and few and short: a client chooses them
        log.info("unknown_fields_ignored", fields=sorted(name[:64] for name in unknown)[:16], count=len(unknown))
    try:
        parsed = decoder.decode(body)
        parsed.check()  # type: ignore[attr-defined]
    except FieldError as exc:
        raise errors.InvalidRequest(str(exc), param=exc.param) from exc
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise errors.from_validation_error(exc) from exc
    body_id = getattr(parsed, "request_id", None)  # the APIs' field; /tokenize has none
    if body_id is not None:  # it names the response and its X-Request-Id header too
        if not valid_request_id(body_id):
            raise errors.InvalidRequest(f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters",
                                        param="request_id")
        request[REQUEST_ID] = body_id
        structlog.contextvars.bind_contextvars(request_id=body_id)
    return parsed, unknown


# what aiohttp decodes (br and zstd only where their packages are installed)
BODY_ENCODINGS = ("identity", "gzip", "deflate") + (("br",) if HAS_BROTLI else ()) + (("zstd",) if HAS_ZSTD else ())


async def _read_body(request: web.Request, timeout_s: float) -> bytes:
    """The whole body, decoded from its Content-Encoding; a body that does not arrive within
    ``timeout_s`` is a 408, one that cannot be decoded or deframed a 400."""
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError as exc:
        raise errors.RequestReadTimeout(f"the request body did not arrive within {timeout_s} s") from exc
    except web_protocol.RequestPayloadError as exc:
        encoding = request.headers.get("Content-Encoding")
        what = f"is not valid {encoding} data" if encoding else "is malformed"
        raise errors.InvalidRequest(f"The request body {what}", param=None) from exc


# bytes that open and close a JSON object or array, everything else weighs nothing
_NESTING = np.zeros(256, dtype=np.int8)
_NESTING[[ord("["), ord("{")]] = 1
_NESTING[[ord("]"), ord("}")]] = -1
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def json_depth(body: bytes) -> int:
    """How deeply a JSON text nests objects and arrays, without parsing it (so without recursion):
    brackets inside strings do not count."""
    opens = body.count(b"[") + body.count(b"{")
    if opens <= 1:
        return opens
    if b'"' in body:
        body = _STRINGS.sub(b"", body)
    levels = np.cumsum(_NESTING[np.frombuffer(body, dtype=np.uint8)], dtype=np.int32)
    return int(levels.max(initial=0))


def _context(request: web.Request, body: GenerationFields, unknown: dict[str, object],
             config: ServerConfig, model: str) -> RequestContext:
    return RequestContext(request_id=request[REQUEST_ID], config=config, model=model, headers=request.headers,
                          query=request.query, api_key=bearer_token(request), user=body.user, extra=unknown)


COMPLETIONS = CompletionsApi()


async def completions(request: web.Request) -> web.StreamResponse:
    body, unknown = await decode_request(request, request_decoder, REQUEST_FIELDS)
    return await _generate(request, COMPLETIONS, body, unknown)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body, unknown = await decode_request(request, chat_request_decoder, CHAT_REQUEST_FIELDS)
    return await _generate(request, ChatApi(), body, unknown)


async def _generate(request: web.Request, api: Api[Any], body: GenerationFields,
                    unknown: dict[str, object]) -> web.StreamResponse:
    """Both APIs' one path: prepare, then stream, or collect the same stream into one response."""
    service = _service(request)
    state = _state(request)
    context = _context(request, body, unknown, state.config, service.model_name)
    structlog.contextvars.bind_contextvars(user=body.user)
    prepared = await service.prepare(api, body, context)
    state.in_flight += 1
    try:
        if body.stream:
            result: web.StreamResponse = await stream_response(request, service, api, prepared,
                                                               state.config.request_timeout_s)
        else:
            response = await with_timeout(service.complete(api, prepared), state.config.request_timeout_s)
            await service.response_ready(prepared, response)
            result = json_response(response, headers=context.response_headers or None)
        return result
    finally:
        state.in_flight -= 1
        service.release(prepared.sequences, flex=context.service_tier == "flex")
        await _account(state, service, prepared)


async def _account(state: ServerState, service: Service, prepared: Prepared[Any]) -> None:
    """Once per finished (or abandoned) request: metrics and quota tokens."""
    usage = prepared.usage
    if usage is None:
        return
    now = time.monotonic()
    if state.metrics is not None:
        ttft = None if prepared.first_token_at is None else prepared.first_token_at - prepared.started_at
        # 499: the client went away (or the stream failed) before the end; still counted and charged
        state.metrics.observe_request(status=200 if prepared.completed else 499, tier=prepared.context.service_tier,
                                      prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                                      ttft_s=ttft, total_s=now - prepared.started_at,
                                      request_id=prepared.context.request_id, user=prepared.context.user,
                                      endpoint=prepared.api_name)
    if prepared.counted:
        project = prepared.context.project or "default"
        await await_me_maybe(service.quota_store.add_tokens(project, usage.total_tokens, now))


TOKENIZE_FIELDS = frozenset(f.encode_name for f in msgspec.structs.fields(TokenizeRequest))
tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


async def tokenize_route(request: web.Request) -> web.Response:
    service = _service(request)
    body, _ = await decode_request(request, tokenize_decoder, TOKENIZE_FIELDS)
    return json_response(await asyncio.to_thread(tokens.tokenize, service, body))


async def detokenize_route(request: web.Request) -> web.Response:
    service = _service(request)
    body, _ = await _decode_plain(request, detokenize_decoder)
    return json_response(tokens.detokenize(service, body))


async def _decode_plain(request: web.Request, decoder: msgspec.json.Decoder[RequestT]) -> tuple[RequestT, None]:
    content_type = request.headers.get("Content-Type", "application/json")
    if not (content_type.startswith("application/json") or "+json" in content_type):
        raise errors.UnsupportedMediaType(f"Unsupported Media Type: expected application/json, got {content_type}")
    try:
        return decoder.decode(await request.read()), None
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise errors.from_validation_error(exc) from exc


async def version_route(request: web.Request) -> web.Response:
    return json_response({"version": __version__})


async def model_route(request: web.Request) -> web.Response:
    """The SDK's ``models.retrieve``: the served model, or the OpenAI 404 envelope."""
    state = _state(request)
    service = _service(request)
    model_id = request.match_info["model_id"]
    for card in _model_cards(state, service):
        if card.id == model_id:
            return json_response(card)
    raise errors.NotFound(f"The model `{model_id}` does not exist.", param="model")


def _model_cards(state: ServerState, service: Service) -> list[ModelCard]:
    """The served model, then each LoRA adapter under ``--adapters-dir`` (selectable by ``model``)."""
    created = int(state.started_at)
    base = ModelCard(id=service.model_name, created=created, root=service.model_name,
                     max_model_len=service.info.context_length)
    return [base, *(ModelCard(id=name, created=created, root=name, parent=service.model_name,
                              max_model_len=service.info.context_length) for name in service.adapter_names())]


async def models(request: web.Request) -> web.Response:
    state = _state(request)
    service = _service(request)
    return json_response(ModelList(data=_model_cards(state, service)))


async def metrics_route(request: web.Request) -> web.Response:
    metrics = _state(request).metrics
    if metrics is None:
        return web.Response(body=b"", headers={"Content-Type": CONTENT_TYPE_LATEST})
    body, content_type = metrics.render(request.headers.get("Accept", ""))
    return web.Response(body=body, headers={"Content-Type": content_type})


async def openapi_route(request: web.Request) -> web.Response:
    return json_response(openapi_document())


async def health(request: web.Request) -> web.Response:
    state = _state(request)
    if state.load_error is not None:
        return json_response({"status": "error", "error": state.load_error}, status=503)
    if state.draining:
        return json_response({"status": "draining"}, status=503)
    failure = state.engine.failure if state.engine is not None else None
    if failure is not None:
        return json_response({"status": "error", "error": failure}, status=503)
    if not state.ready:
        return json_response({"status": "loading"}, status=503)
    return json_response({"status": "ok"})


async def _load_engine(app: web.Application) -> None:
    state = app[STATE]
    try:
        engine = build_engine(state.config, state.pm)
        await engine.start()
        state.engine = engine
        if state.engine_started is not None:
            state.engine_started(engine)
        info = engine.info
        fingerprint = state.pm.hook.trtserver_system_fingerprint(engine_info=info)
        model_name = state.config.served_model_name or info.model_name
        quota_store = state.pm.hook.trtserver_quota_store(config=state.config)
        state.service = Service(engine, state.pm, state.config, model_name=model_name,
                                system_fingerprint=fingerprint, quota_store=quota_store,
                                extras=ChatApi.start_up(state.config, state.pm, engine))
        state.ready = True
        log.info("engine_ready", engine=info.backend, model=model_name, context_length=info.context_length)
    except Exception as exc:
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.exception("engine_failed_to_load")
        raise


async def _engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(_load_engine(app))
    app[STATE].engine_task = task
    yield
    state = app[STATE]
    state.draining = True
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    if state.engine is not None:
        await state.engine.shutdown()


def create_app(config: ServerConfig, pm: pluggy.PluginManager | None = None) -> web.Application:
    if pm is None:
        pm = new_plugin_manager()
        allowlist = config.plugin_allowlist if config.plugin_allowlist is not None else allowlist_from_env()
        load_plugins(pm, extra=config.plugins, allowlist=allowlist)
    app = web.Application(middlewares=[error_middleware], client_max_size=config.max_body_bytes)
    state = ServerState(config=config, pm=pm)
    state.metrics = Metrics(lambda: state.engine.stats() if state.engine is not None and state.ready else None,
                            exemplars=config.metrics_exemplars)
    app[STATE] = state
    app.on_response_prepare.append(_on_response_prepare)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model_id}", model_route)
    app.router.add_post("/tokenize", tokenize_route)
    app.router.add_post("/detokenize", detokenize_route)
    app.router.add_get("/version", version_route)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_route)
    app.router.add_get("/openapi.json", openapi_route)
    app.cleanup_ctx.append(_engine_lifecycle)
    pm.hook.trtserver_app_created(app=app, config=config)
    return app
