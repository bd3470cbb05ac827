"""Every plugin hook trtserver calls. Each docstring is that hook's documentation.

A plugin is a module or object with functions decorated ``@trtserver.hookimpl`` whose names match
the specs below (pluggy matches arguments by name, so an implementation may accept fewer
arguments than the spec lists). Hooks run at start-up or once per request, never per token:
per-step work lives on the objects some hooks return (``TokenConstraint``, ``LogitsProcessor``,
``StopChecker``), whose Protocols live in ``trtserver.engine.base`` and ``trtserver.text``.

Hooks are synchronous. The two request hooks that may need I/O (``trtserver_request_received``
and ``trtserver_response_ready``) may instead return an awaitable, which is awaited.

Hooks run in the server process. On the PyTorch engine the model runs in a process of its own
(``--engine-process``, the default), so the per-step objects that guided backends
(``trtserver_register_guided_backends``) and ``trtserver_logits_processors`` return travel
there with each request, pickled by cloudpickle: closures, lambdas and the classes of a
``--plugin file.py`` travel by value, other classes by import name, and the served model's
``Tokenizer`` as a reference to that process's own copy. Keep them small (a compiled guide
may cross as its recipe: define ``__reduce__``), and hold no locks, sockets or open files.
State they change there is not seen here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from aiohttp import web

    from trtserver.config import ServerConfig
    from trtserver.engine.base import Engine, EngineInfo, GuidedBackend, LogitsProcessor
    from trtserver.protocol import (
        ChatCompletionRequest,
        ChatCompletionResponse,
        CompletionRequest,
        CompletionResponse,
    )
    from trtserver.quota import QuotaStore
    from trtserver.request_context import RequestContext
    from trtserver.text import StopChecker
    from trtserver.tokenizer import Tokenizer
    from trtserver.tool_calls import ToolCallParser

PROJECT = "trtserver"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# --- start-up -------------------------------------------------------------------------------


@hookspec
def trtserver_register_engines(register: Callable[[str, Callable[[ServerConfig], Engine]], None]) -> None:
    """Add engines that ``--engine NAME`` can select.

    :param register: call ``register(name, factory)`` once per engine; ``factory(config)`` gets
        the server configuration (engine directory, dtype, slots...) and returns an object
        implementing ``trtserver.engine.base.Engine``. It is called once, at start-up, and only
        for the engine that was selected.
    :returns: nothing; the return value is ignored.

    Fires once at start-up, before the engine is built. Registering a name twice stops start-up.

    Subclass ``trtserver.engine.base.EngineBase`` for the members most engines need not change:
    ``check(request)`` lists ``(param, reason)`` pairs the engine must refuse for a request (the
    client gets a 400 naming the first), ``failure`` says why the engine can no longer serve, and
    ``threads_bound`` whether it pinned its threads; the engine sets ``info`` and ``tokenizer`` in
    ``__init__``. Both APIs reach the engine the same way:
    a chat request is rendered and tokenized by the server, so an engine sees only token ids.
    """


@hookspec
def trtserver_app_created(app: web.Application, config: ServerConfig) -> None:
    """Extend the aiohttp application: add routes, middlewares, startup/cleanup callbacks.

    :param app: the ``aiohttp.web.Application`` built by ``create_app``; not yet started.
    :param config: the server configuration.
    :returns: nothing; the return value is ignored.

    Fires once in ``create_app``, after trtserver's own routes are added.
    """


@hookspec(firstresult=True)
def trtserver_system_fingerprint(engine_info: EngineInfo) -> str | None:
    """The ``system_fingerprint`` returned in every response and chunk.

    :param engine_info: the started engine's info; ``engine_info.fingerprint_inputs`` holds the
        manifest facts (weights checksum, dtype, runtime versions) that identify the build.
    :returns: a short string, or None to let another plugin answer. firstresult: the first
        non-None answer wins; the built-in plugin is ``trylast`` so any other overrides it.

    Fires once, after the engine has started.
    """


@hookspec(firstresult=True)
def trtserver_quota_store(config: ServerConfig) -> QuotaStore | None:
    """Where per-project request and token counts are kept (``service_tier`` quotas).

    :param config: the server configuration (its ``quotas`` table holds the limits).
    :returns: an object implementing ``trtserver.quota.QuotaStore`` (for example backed by a
        shared store so replicas share quotas), or None for the next plugin; the built-in
        in-memory store answers last. firstresult.

    Fires once at start-up.
    """


@hookspec(firstresult=True)
def trtserver_chat_template(config: ServerConfig, model_template: str | None) -> str | None:
    """The chat template that ``/v1/chat/completions`` renders messages with.

    :param config: the server configuration (``engine_dir`` says which model is served).
    :param model_template: the engine directory's own template text (the manifest's
        ``chat_template`` file, else ``tokenizer_config.json``'s ``chat_template``), or None when
        the model has none; return it edited to patch it.
    :returns: Jinja template text, rendered in jinja2's sandbox exactly as transformers renders
        ``apply_chat_template`` (variables ``messages``, ``tools``, ``add_generation_prompt``,
        ``bos_token``, ``eos_token`` and the request's ``chat_template_kwargs``), or None to let
        the next plugin answer and, after all of them, the engine directory's template. firstresult.
        ``--chat-template`` set by the operator wins over every plugin (the hook is then not called).
        A template that does not compile stops start-up with an error.

    Fires once at start-up.
    """


@hookspec
def trtserver_register_tool_parsers(
    register: Callable[[str, Callable[[list[dict[str, object]]], ToolCallParser]], None],
) -> None:
    """Add tool-call parsers that ``--tool-call-parser NAME`` can select.

    :param register: call ``register(name, factory)`` once per parser. For each choice of a chat
        request with ``tools`` and ``tool_choice`` ``"auto"``, the server calls
        ``factory(tools)`` (the request's tools, OpenAI-shaped dicts) and gets a
        ``trtserver.tool_calls.ToolCallParser``: ``feed(text)`` takes each piece of generated
        text and returns the ``ToolDelta`` items it completes (``ContentDelta``,
        ``ToolCallStart``, ``ToolCallArguments``), ``finish()`` returns the rest at the end.
        Non-streamed responses are the same deltas collected.
    :returns: nothing; the return value is ignored.

    Fires once at start-up. A name registered twice, by one plugin or two, stops start-up with an
    error naming both plugins. The built-in ``hermes`` parser (``<tool_call>{json}</tool_call>``,
    Hermes and Qwen models) is registered through this hook too.
    """


@hookspec
def trtserver_register_guided_backends(
    register: Callable[[str, GuidedBackend], None],
) -> None:
    """Add guided-decoding backends that a request's ``guided_decoding_backend`` (or
    ``structured_outputs.backend``) can name; a request that names none gets ``xgrammar``.

    :param register: call ``register(name, factory)`` once per backend name (an alias is one
        more name for the same factory). Names match whatever their case. For each request that
        asks for guided output, the server calls ``factory(spec, context)``: ``spec`` says what to
        constrain to (``spec.kind`` in json, json_object, regex, choice, grammar), ``context``
        holds the tokenizer, the logits width and EOS ids of the served model and the compile
        time limit. It returns a ``GuidedDecoder`` whose ``new_state()`` gives each sequence a
        ``TokenConstraint`` (per step: ``fill_bitmask``, ``accept_token``, ``is_terminated``), or
        raises ``trtserver.errors.InvalidRequest`` when it cannot compile this spec (the client
        gets a 400 naming the field). The factory runs in a worker thread, never on the event
        loop, and should cache what it compiles (the same spec arrives again and again). With the
        engine in its own process the decoder is pickled to it with each request (see the top of
        this page); the ``trtserver-guided`` backends' decoders cross as their recipe and compile
        once more there, on first use.
    :returns: nothing; the return value is ignored.

    Fires once at start-up. A name registered twice, by one plugin or two, stops start-up with an
    error naming both plugins. A request naming a backend nobody registered gets a 400 with
    ``param`` ``guided_decoding_backend``. The ``trtserver-guided`` plugin registers
    ``xgrammar``, ``llguidance``, ``outlines``, ``lm-format-enforcer`` (with their aliases, and
    ``auto``), each only when its library is installed.
    """


# --- per request ----------------------------------------------------------------------------


@hookspec
def trtserver_request_received(
    request: CompletionRequest | ChatCompletionRequest, context: RequestContext
) -> Awaitable[None] | None:
    """Inspect a validated request before any work is done: auth, quotas, audit, prompt logging.

    :param request: the decoded ``CompletionRequest`` or ``ChatCompletionRequest`` (read it; do
        not mutate it). The fields both APIs take are on ``trtserver.protocol.GenerationFields``.
    :param context: the request's id, headers, query, client ``user``, and the app config.
    :returns: None, or an awaitable that is awaited. To reject the request, raise a
        ``trtserver.errors.APIError`` subclass (``InvalidRequest`` -> 400, ``PermissionDenied``
        -> 403, ``RateLimited`` -> 429...): the client gets that error in the OpenAI envelope.

    Fires once per request, after validation and the model check, before tokenization.
    """


@hookspec
def trtserver_logits_processors(
    request: CompletionRequest | ChatCompletionRequest, context: RequestContext, tokenizer: Tokenizer
) -> list[Callable[[], LogitsProcessor]] | None:
    """Per-sequence logits processors for a request.

    :param request: the decoded request.
    :param context: the request context.
    :param tokenizer: the served model's ``trtserver.tokenizer.Tokenizer`` (to turn words into ids).
    :returns: a list of zero-argument factories; each sequence calls every factory once and
        the engine calls the processor once per decode step with that sequence's generated
        token ids and its logits row (modify it in place). None or [] for no processors. The
        factories are pickled to the engine process with the request (see the top of this
        page); one that cannot be pickled fails the request with a 500 naming it.

    Fires once per request, after tokenization.
    """


@hookspec
def trtserver_stop_checkers(
    request: CompletionRequest | ChatCompletionRequest, context: RequestContext
) -> list[Callable[[], StopChecker]] | None:
    """Custom stop conditions on generated text, beyond ``stop`` strings and ``stop_token_ids``.

    :param request: the decoded request (read plugin-specific fields from ``context.extra``,
        which holds body fields trtserver itself does not know).
    :param context: the request context.
    :returns: a list of zero-argument factories; each choice calls every factory once and gets a
        ``trtserver.text.StopChecker`` whose ``find`` is given the text decoded so far and whose
        ``hold`` says how much trailing text to withhold from a stream because it could still
        become a match. The earliest match over all checkers and stop strings wins. None or []
        for none.

    Fires once per request, after tokenization.
    """


@hookspec
def trtserver_response_ready(
    request: CompletionRequest | ChatCompletionRequest,
    response: CompletionResponse | ChatCompletionResponse,
    context: RequestContext,
) -> Awaitable[None] | None:
    """See a finished response: accounting, audit, logging.

    :param request: the decoded request.
    :param response: the complete response; for a streamed request, the chunks collected into
        one ``CompletionResponse`` or ``ChatCompletionResponse`` (same text, usage and finish
        reasons as were streamed).
    :param context: the request context.
    :returns: None, or an awaitable that is awaited. Exceptions are logged and do not reach
        the client (the response has been sent already for streams).

    Fires once per request that completed, after the last byte was produced. Not fired for
    requests that failed or whose client disconnected.
    """


HOOK_NAMES: tuple[str, ...] = tuple(name for name in dir() if name.startswith("trtserver_"))
