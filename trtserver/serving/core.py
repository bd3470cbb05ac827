"""The serving core, the same for every API: a request's prompts and sampling in, per-choice pieces out.

An API (``completions.py``, ``chat.py``) says how its request becomes a ``Plan`` and prompt token
ids, and how pieces become its chunks; everything between is here: the request checks, tiers and
quotas, the plugins' per-request objects, the engine requests, detokenizing and stops. There is
one path: ``stream()`` yields the API's chunks; ``complete()`` collects that same stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import pluggy
import structlog

from trtserver.adapters import AdapterRegistry
from trtserver.config import ServerConfig
from trtserver.engine.base import Engine, GenerationRequest, GuidedBackend, GuidedDecoder, SequenceOutput
from trtserver.errors import InvalidRequest, Overloaded, Unsupported
from trtserver.guided import GuideContext, GuideSpec
from trtserver.plugins import await_me_maybe, guided_backend_key, registrations
from trtserver.protocol import GenerationFields, Usage
from trtserver.quota import MemoryQuotaStore, QuotaStore, decide_tier
from trtserver.request_context import RequestContext
from trtserver.serving import checks
from trtserver.serving.checks import Plan, PromptInput
from trtserver.serving.choices import ChoiceState, PromptScores, make_usage
from trtserver.serving.streams import merge_streams
from trtserver.text import IncrementalDecoder, StopChecker, StopStrings, TextStream

log = structlog.get_logger("trtserver.serving")

RequestT = TypeVar("RequestT", bound=GenerationFields)
ChunkIn = TypeVar("ChunkIn", contravariant=True)
ResponseOut = TypeVar("ResponseOut", covariant=True)


@dataclass(slots=True)
class Prepared(Generic[RequestT]):
    """A request ready to run: engine requests plus what is needed to shape the output."""

    request: RequestT
    plan: Plan
    context: RequestContext
    response_id: str
    created: int
    prompts: list[PromptInput]
    engine_requests: list[GenerationRequest]
    stop_factories: list[Callable[[], StopChecker]] = field(default_factory=list)
    counted: bool = False  # charged against the project's quota
    usage: Usage | None = None  # set when the run ends, however it ends
    started_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    sequences: int = 1  # reserved in the waiting bound until the request ends
    completed: bool = False  # False: the client went away or it failed
    api_state: Any = None  # what the API keeps for this request (the chat tools' mode)
    api_name: str = "completions"  # the endpoint, as metrics label it
    choices: dict[tuple[int, int], ChoiceState] = field(default_factory=dict)  # by (prompt, sequence)


@dataclass(slots=True)
class Piece:
    """What one engine delta did to one choice: the text it releases, and whether it was the first."""

    choice: ChoiceState
    delta: SequenceOutput
    text: str
    first: bool
    prompt_scores: PromptScores | None


class Api(Protocol[RequestT]):
    """One API's shaper: its request in, its chunks and response out; all else is the core's."""

    name: str  # the endpoint label in metrics
    id_prefix: str

    def plan(self, request: RequestT) -> Plan: ...

    def prompts(self, request: RequestT, service: Service) -> list[PromptInput]: ...

    def guide(self, request: RequestT, prepared_state: Any) -> tuple[GuideSpec, str] | None: ...

    def prepare_state(self, request: RequestT, service: Service) -> Any: ...

    def chunks(self, prepared: Prepared[RequestT], service: Service) -> AsyncGenerator[Any, None]:
        """The API's chunks: it makes the choices (``service.new_choices``) and shapes ``service.pieces``."""
        ...

    def joiner(self, prepared: Prepared[RequestT], service: Service) -> Joiner[Any, Any]: ...


class Joiner(Protocol[ChunkIn, ResponseOut]):
    """A stream's chunks joined back into that API's whole response."""

    def add(self, chunk: ChunkIn) -> None: ...

    def response(self) -> ResponseOut: ...


class Service:
    """One per served model: admits requests, builds their engine requests, streams their choices."""

    def __init__(self, engine: Engine, pm: pluggy.PluginManager, config: ServerConfig, *,
                 model_name: str, system_fingerprint: str | None, quota_store: QuotaStore | None = None,
                 extras: dict[str, Any] | None = None) -> None:
        self.engine = engine
        self.pm = pm
        self.config = config
        self.model_name = model_name
        self.system_fingerprint = system_fingerprint
        self.tokenizer = engine.tokenizer
        token_bytes = self.tokenizer.token_bytes  # built now, not on the first request
        # a token covers at most this many bytes: a longer text cannot fit the context, untokenized
        self.longest_token_bytes = max((len(b) for b in token_bytes), default=0) if token_bytes else 0
        self.info = engine.info
        self.quota_store: QuotaStore = quota_store if quota_store is not None else MemoryQuotaStore()
        self.adapters = AdapterRegistry(config.adapters_dir, max_rank=config.max_lora_rank) \
            if config.adapters_dir else None
        self.extras = extras or {}  # per-API start-up objects (the chat template, tool parsers)
        self.guided_backends = guided_backends(pm)
        self.flex_in_flight = 0
        # sequences of admitted requests; beyond the engine's slots they wait. Counted here, at
        # admission, because the engine only sees a request once its worker picks it up.
        self.admitted_sequences = 0

    def adapter_names(self) -> list[str]:
        return self.adapters.names() if self.adapters is not None else []

    @property
    def context_length(self) -> int:
        context = self.info.context_length
        return min(context, self.config.max_model_len) if self.config.max_model_len is not None else context

    # --- preparing -------------------------------------------------------------------------

    async def prepare(self, api: Api[RequestT], request: RequestT,
                      context: RequestContext) -> Prepared[RequestT]:
        plan = api.plan(request)
        adapter = checks.check_model(request, self.model_name, self.adapter_names if self.adapters else None)
        if adapter is not None:
            plan = dataclasses.replace(plan, adapter=adapter)
        checks.check_limits(request, plan, self.config, self.info)
        sequences = plan.width * plan.prompt_count
        self._admit(sequences)
        try:
            return await self._prepare(api, request, plan, context, sequences)
        except BaseException:
            self.release(sequences, flex=context.service_tier == "flex")
            raise

    def _admit(self, sequences: int) -> None:
        """Reserve room in the bounded waiting queue, or refuse with 503 (no await in between)."""
        slots = self.engine.stats().slots_total
        waiting = max(self.admitted_sequences - slots, 0) if slots else self.engine.stats().waiting
        if waiting >= self.config.max_waiting and self.admitted_sequences + sequences > slots:
            raise Overloaded("too many requests are waiting; retry shortly")
        self.admitted_sequences += sequences

    def release(self, sequences: int, *, flex: bool) -> None:
        """Give back what ``prepare`` reserved, once the request has ended (however it ended)."""
        self.admitted_sequences -= sequences
        if flex:
            self.flex_in_flight -= 1

    async def _prepare(self, api: Api[RequestT], request: RequestT, plan: Plan,
                       context: RequestContext, sequences: int) -> Prepared[RequestT]:
        tier = await decide_tier(request.service_tier, context.query.get("ai_project_id"), context.api_key,
                                 self.config, self.quota_store, self.flex_in_flight, self.config.max_flex_waiting)
        context.service_tier = tier.tier
        if tier.tier == "flex":  # counted right after the check, with no await in between
            self.flex_in_flight += 1
        context.project = tier.project
        context.response_headers.update(tier.headers)
        for result in self.pm.hook.trtserver_request_received(request=request, context=context):
            await await_me_maybe(result)
        state = api.prepare_state(request, self)
        prompts = await asyncio.to_thread(api.prompts, request, self)  # a long prompt would hold the loop
        max_tokens = checks.resolve_max_tokens(plan, prompts, self.config, self.info)
        sampling = checks.sampling_params(request, plan, max_tokens, self.info)
        guide = api.guide(request, state)
        guided = None
        if guide is not None:
            try:
                guided = await self._guided_decoder(*guide)
            except InvalidRequest as exc:  # a backend that cannot compile the schema: blame the field carrying it
                if exc.param is None:
                    sent = _sent_param(request, plan, "guided")
                    exc.param = "tools" if sent == "guided" and getattr(request, "tools", None) else sent
                raise
        processors = [f for fs in self.pm.hook.trtserver_logits_processors(request=request, context=context,
                                                                            tokenizer=self.tokenizer)
                      if fs for f in fs]
        if processors and not self.info.capabilities.logits_processors:
            raise Unsupported(f"this engine ({self.info.backend}) cannot run logits processors",
                              param="logits_processors")
        stops: list[Callable[[], StopChecker]] = [
            f for fs in self.pm.hook.trtserver_stop_checkers(request=request, context=context) if fs for f in fs]
        stop_strings = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        if stop_strings:
            stops.insert(0, lambda: StopStrings(stop_strings))
        response_id = f"{api.id_prefix}-{request.request_id or context.request_id}"
        engine_id = new_request_id()  # clients may reuse X-Request-Id; engine ids must be unique
        priority = checks.engine_priority(request, tier.priority)
        engine_requests = [
            GenerationRequest(
                request_id=f"{engine_id}-{i}",
                prompt_token_ids=prompt.token_ids,
                sampling=sampling,
                n=plan.width,
                priority=priority,
                adapter=plan.adapter,
                guided=guided,
                guide_spec=guide[0] if guide else None,
                guide_backend=guide[1] if guide else None,
                logits_processors=processors,
            )
            for i, prompt in enumerate(prompts)
        ]
        for engine_request in engine_requests:
            for param, reason in self.engine.check(engine_request):
                raise Unsupported(reason, param=_sent_param(request, plan, param))
        return Prepared(request, plan, context, response_id, int(time.time()), prompts, engine_requests, stops,
                        counted=tier.counted, sequences=sequences, api_state=state, api_name=api.name)

    async def _guided_decoder(self, spec: GuideSpec, backend: str) -> GuidedDecoder:
        if not self.info.capabilities.guided_decoding:
            raise Unsupported(f"this engine ({self.info.backend}) does not support guided decoding",
                              param="guided_decoding_backend")
        factory = self.guided_backends.get(guided_backend_key(backend))
        if factory is None:
            known = ", ".join(sorted(self.guided_backends)) or "none"
            raise InvalidRequest(f"guided decoding backend {backend!r} is not available on this server "
                                 f"(available: {known}; the trtserver-guided plugin adds xgrammar, llguidance, "
                                 "outlines and lm-format-enforcer, each with its extra)",
                                 param="guided_decoding_backend")
        context = GuideContext(self.tokenizer, self.info.vocab_size, self.info.eos_token_ids,
                               self.config.guided_compile_timeout_s)
        return await asyncio.to_thread(factory, spec, context)

    # --- running ---------------------------------------------------------------------------

    def new_choices(self, prepared: Prepared[Any], *, echo: Callable[[PromptInput], str] | None = None
                    ) -> dict[tuple[int, int], ChoiceState]:
        """A state per (prompt, sequence): the detokenizer, stop checkers and counts of each choice."""
        request = prepared.request
        eos = () if request.ignore_eos else self.info.eos_token_ids
        cached = 0 if self.info.capabilities.prefix_caching else None
        choices = {}
        for p, prompt in enumerate(prepared.prompts):
            for s in range(prepared.plan.width):
                decoder = IncrementalDecoder(self.tokenizer, skip_special_tokens=request.skip_special_tokens,
                                             spaces_between_special_tokens=request.spaces_between_special_tokens)
                stream = TextStream(decoder, [factory() for factory in prepared.stop_factories],
                                    include_stop_str_in_output=request.include_stop_str_in_output)
                choices[(p, s)] = ChoiceState(p, s, stream, len(prompt.token_ids),
                                              echo_text=echo(prompt) if echo is not None else "",
                                              eos_token_ids=eos, cached_tokens=cached)
        prepared.choices = choices
        return choices

    async def pieces(self, prepared: Prepared[Any], choices: dict[tuple[int, int], ChoiceState]
                     ) -> AsyncGenerator[Piece, None]:
        """Every engine delta applied to its choice, as pieces; closing this early aborts the engine
        requests. ``prepared.usage`` is set when it ends, however it ends."""
        # the engine sends a prompt's logprobs once (with its first sequence); every choice echoes them
        prompt_scores: dict[int, PromptScores] = {}
        remaining = len(choices)
        try:
            async with aclosing(merge_streams([self.engine.generate(r) for r in prepared.engine_requests])) as out:
                async for prompt_index, delta in out:
                    if delta.prompt_token_logprobs is not None:
                        prompt_scores[prompt_index] = PromptScores(
                            delta.prompt_token_logprobs,
                            delta.prompt_logprobs or [None] * len(delta.prompt_token_logprobs))
                    choice = choices.get((prompt_index, delta.index))
                    if choice is None or choice.finished:
                        continue
                    first = not choice.started
                    choice.started = True
                    if delta.num_cached_tokens and choice.cached_tokens is not None:
                        choice.cached_tokens = delta.num_cached_tokens
                    text = choice.advance(delta)
                    if choice.finished and delta.finish_reason is None:  # we stopped it (stop string): free it
                        self.engine.abort(prepared.engine_requests[prompt_index].request_id, delta.index)
                    if prepared.first_token_at is None and (text or delta.token_ids):
                        prepared.first_token_at = time.monotonic()
                    remaining -= choice.finished
                    yield Piece(choice, delta, text, first, prompt_scores.get(prompt_index))
                    if remaining == 0:
                        break
            prepared.completed = True
        finally:
            prepared.usage = self.usage(prepared, choices.values())

    def usage(self, prepared: Prepared[Any], choices: Iterable[ChoiceState]) -> Usage:
        prompt_tokens = sum(len(p.token_ids) for p in prepared.prompts)
        completion = 0
        cached: dict[int, int] | None = {} if self.info.capabilities.prefix_caching else None
        for c in choices:
            completion += c.completion_tokens
            if cached is not None and c.cached_tokens:
                cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.cached_tokens)
        return make_usage(prompt_tokens, completion, None if cached is None else sum(cached.values()))

    def stream(self, api: Api[Any], prepared: Prepared[Any]) -> AsyncGenerator[Any, None]:
        """What a streaming client gets: the API's chunks (its usage chunk last, when asked)."""
        return api.chunks(prepared, self)

    async def complete(self, api: Api[Any], prepared: Prepared[Any]) -> Any:
        """The non-streaming response: the same chunks, joined by the API's joiner."""
        joiner = api.joiner(prepared, self)
        async with aclosing(api.chunks(prepared, self)) as chunks:
            async for chunk in chunks:
                joiner.add(chunk)
        return joiner.response()

    def wants_response_ready(self) -> bool:
        return bool(self.pm.hook.trtserver_response_ready.get_hookimpls())

    async def response_ready(self, prepared: Prepared[Any], response: object) -> None:
        """Fire ``trtserver_response_ready``; a failing plugin is logged, never the client's problem."""
        try:
            for result in self.pm.hook.trtserver_response_ready(request=prepared.request, response=response,
                                                               context=prepared.context):
                await await_me_maybe(result)
        except Exception:
            log.exception("response_ready_hook_failed")


def guided_backends(pm: pluggy.PluginManager) -> dict[str, GuidedBackend]:
    """Every guided-decoding backend plugins register, by name (lower case); a name registered
    twice raises ``PluginLoadError`` naming both plugins."""
    return {name: registration.factory for name, registration in registrations(pm, "guided_backends").items()}


def _sent_param(request: GenerationFields, plan: Plan, param: str) -> str:
    """An engine names a refused feature generically; blame the field the client actually sent."""
    if param.startswith("guided") or param in ("structured_outputs", "response_format"):
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                     "response_format"):
            if getattr(request, name, None) is not None:
                return name
    if param in ("n", "best_of"):
        return "best_of" if plan.width > plan.n else "n"
    return plan.blame(param)


def new_request_id() -> str:
    return uuid.uuid4().hex
