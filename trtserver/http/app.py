"""The aiohttp application: routes, SSE, the one error mapping, engine lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import msgspec
import pluggy
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from trtserver import __version__, errors
from trtserver.config import ServerConfig
from trtserver.engine.select import build_engine
from trtserver.http.body import parse, read_json
from trtserver.http.metrics import Metrics
from trtserver.http.middleware import (
    bearer_token,
    end_requests,
    error_middleware,
    json_response,
    on_response_prepare,
    valid_request_id,
)
from trtserver.http.openapi import openapi_document
from trtserver.http.sse import stream_response, with_timeout
from trtserver.http.state import MAX_REQUEST_ID_CHARS, REQUEST_ID, STATE, ServerState
from trtserver.plugins import allowlist_from_env, await_me_maybe, load_plugins, new_plugin_manager
from trtserver.protocol import (
    CHAT_REQUEST_FIELDS,
    REQUEST_FIELDS,
    DetokenizeRequest,
    GenerationFields,
    ModelCard,
    ModelList,
    TokenizeRequest,
    chat_request_decoder,
    request_decoder,
)
from trtserver.request_context import RequestContext
from trtserver.serving import Api, Prepared, Service, tokens
from trtserver.serving.chat import ChatApi
from trtserver.serving.completions import CompletionsApi

__all__ = ["STATE", "ServerState", "create_app", "create_metrics_app", "end_requests", "json_response"]

log = structlog.get_logger("trtserver.http.app")



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
    """Body -> the route's request Struct and its unknown fields; a body ``request_id`` names the response."""
    config = request.app[STATE].config
    raw = await read_json(request, max_depth=config.max_json_depth, timeout_s=config.body_timeout_s)
    parsed, unknown = parse(raw, decoder, known)
    body_id = getattr(parsed, "request_id", None)  # the APIs' field; /tokenize has none
    if body_id is not None:  # it names the response and its X-Request-Id header too
        if not valid_request_id(body_id):
            raise errors.InvalidRequest(f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters",
                                        param="request_id")
        request[REQUEST_ID] = body_id
        structlog.contextvars.bind_contextvars(request_id=body_id)
    return parsed, unknown


def _context(request: web.Request, body: GenerationFields, unknown: dict[str, object],
             config: ServerConfig, model: str) -> RequestContext:
    return RequestContext(request_id=request[REQUEST_ID], config=config, model=model, headers=request.headers,
                          query=request.query, api_key=bearer_token(request), user=body.user, extra=unknown)


COMPLETIONS = CompletionsApi()
CHAT = ChatApi()


async def completions(request: web.Request) -> web.StreamResponse:
    body, unknown = await decode_request(request, request_decoder, REQUEST_FIELDS)
    return await _generate(request, COMPLETIONS, body, unknown)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body, unknown = await decode_request(request, chat_request_decoder, CHAT_REQUEST_FIELDS)
    return await _generate(request, CHAT, body, unknown)


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
DETOKENIZE_FIELDS = frozenset(f.encode_name for f in msgspec.structs.fields(DetokenizeRequest))
tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


async def tokenize_route(request: web.Request) -> web.Response:
    service = _service(request)
    body, _ = await decode_request(request, tokenize_decoder, TOKENIZE_FIELDS)
    return json_response(await asyncio.to_thread(tokens.tokenize, service, body))


async def detokenize_route(request: web.Request) -> web.Response:
    service = _service(request)
    parsed, _ = await decode_request(request, detokenize_decoder, DETOKENIZE_FIELDS)
    return json_response(tokens.detokenize(service, parsed))


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


def create_metrics_app(app: web.Application) -> web.Application:
    """``/metrics`` alone, for the ``metrics_port`` listener: the main app's state (its registry, its
    metrics keys) behind the same middleware."""
    metrics_app = web.Application(middlewares=[error_middleware])
    metrics_app[STATE] = app[STATE]
    metrics_app.on_response_prepare.append(on_response_prepare)
    metrics_app.router.add_get("/metrics", metrics_route)
    return metrics_app


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
    app.on_response_prepare.append(on_response_prepare)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model_id}", model_route)
    app.router.add_post("/tokenize", tokenize_route)
    app.router.add_post("/detokenize", detokenize_route)
    app.router.add_get("/version", version_route)
    app.router.add_get("/health", health)
    if config.metrics_port is None:  # else on a listener of its own (create_metrics_app)
        app.router.add_get("/metrics", metrics_route)
    app.router.add_get("/openapi.json", openapi_route)
    app.cleanup_ctx.append(_engine_lifecycle)
    pm.hook.trtserver_app_created(app=app, config=config)
    return app
