"""CompletionService: a request in, a stream of chunks out (or those chunks collected).

There is one path: ``stream()`` yields ``CompletionResponse`` chunks; ``complete()`` collects
them into the non-streaming response (and ranks ``best_of`` there). One shortcut: once a streamed
response's first chunk is out, an engine with ``push_to`` hands it each delta from its own
dispatch, and the same ``on_delta`` shapes it and writes it to the client (``Prepared.sink``);
the engine's final deltas, errors and deltas met by a backed-up socket stay on the generator.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Protocol

import pluggy
import structlog
from msgspec import UNSET

from trtserver import params
from trtserver.bad_words import bad_words_factory
from trtserver.choices import ChoiceMerger, ChoiceState, PromptScores, TokenNamer, choice_piece
from trtserver.config import ServerConfig
from trtserver.engine.base import DeltaSink, Engine, GenerationRequest, GuidedDecoder, SequenceOutput
from trtserver.errors import InvalidRequest, Overloaded, Unsupported
from trtserver.guided import GuideContext, GuideSpec, guide_spec_from_request
from trtserver.plugins import await_me_maybe
from trtserver.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from trtserver.quota import MemoryQuotaStore, QuotaStore, decide_tier
from trtserver.request_context import RequestContext
from trtserver.streams import merge_streams
from trtserver.text import IncrementalDecoder, StopChecker, StopStrings, TextStream

log = structlog.get_logger("trtserver.serving")


@dataclass(slots=True)
class Prepared:
    """A request ready to run: engine requests plus what is needed to shape the output."""

    request: CompletionRequest
    context: RequestContext
    response_id: str
    created: int
    prompts: list[params.PromptInput]
    engine_requests: list[GenerationRequest]
    stop_factories: list[Callable[[], StopChecker]] = field(default_factory=list)
    counted: bool = False  # charged against the project's quota
    usage: Usage | None = None  # set when the run ends, however it ends
    started_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    sequences: int = 1  # reserved in the waiting bound until the request ends
    completed: bool = False  # False: the client went away or it failed
    # set by the SSE writer once the headers are out: chunks may go straight to the client
    sink: ChunkSink | None = None


class ChunkSink(Protocol):
    """Where a streaming response's chunks can be written without waiting (``sse.EventWriter``)."""

    def writable(self) -> bool: ...

    def write(self, chunk: CompletionResponse) -> None: ...


class CompletionService:
    def __init__(self, engine: Engine, pm: pluggy.PluginManager, config: ServerConfig, *,
                 model_name: str, system_fingerprint: str | None, quota_store: QuotaStore | None = None) -> None:
        self.engine = engine
        self.pm = pm
        self.config = config
        self.model_name = model_name
        self.system_fingerprint = system_fingerprint
        self.tokenizer = engine.tokenizer
        self.tokenizer.token_bytes  # noqa: B018 - built now (~0.1 s), not on the first request
        self.info = engine.info
        self.quota_store: QuotaStore = quota_store or MemoryQuotaStore()
        self.flex_in_flight = 0
        # sequences of admitted requests; beyond the engine's slots they wait. Counted here, at
        # admission, because the engine only sees a request once its worker picks it up.
        self.admitted_sequences = 0

    # --- preparing -------------------------------------------------------------------------

    async def prepare(self, request: CompletionRequest, context: RequestContext) -> Prepared:
        params.check_model(request, self.model_name)
        params.check_limits(request, self.config, self.info)
        sequences = (request.best_of or request.n) * len(request.prompts)
        self._admit(sequences)
        try:
            return await self._prepare(request, context, sequences)
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

    async def _prepare(self, request: CompletionRequest, context: RequestContext, sequences: int) -> Prepared:
        tier = await decide_tier(request.service_tier, context.query.get("ai_project_id"), context.api_key,
                                 self.config, self.quota_store, self.flex_in_flight, self.config.max_flex_waiting)
        context.service_tier = tier.tier
        if tier.tier == "flex":  # counted right after the check, with no await in between
            self.flex_in_flight += 1
        context.project = tier.project
        context.response_headers.update(tier.headers)
        for result in self.pm.hook.trtserver_request_received(request=request, context=context):
            await await_me_maybe(result)
        prompts = params.tokenize_prompts(request, self.tokenizer, self.info)
        max_tokens = params.resolve_max_tokens(request, prompts, self.config, self.info)
        width = request.best_of or request.n
        sampling = params.sampling_params(request, max_tokens, self.info,
                                          rank_by_logprob=width > request.n and not request.use_beam_search)
        guide = guide_spec_from_request(request)
        guided = await self._guided_decoder(*guide) if guide is not None else None
        processors = [f for fs in self.pm.hook.trtserver_logits_processors(request=request, context=context,
                                                                            tokenizer=self.tokenizer)
                      if fs for f in fs]
        if request.bad_words:
            processors.append(bad_words_factory(request.bad_words, self.tokenizer))
        if processors and not self.info.capabilities.logits_processors:
            raise Unsupported(f"this engine ({self.info.backend}) cannot run logits processors",
                              param="logits_processors")
        stops: list[Callable[[], StopChecker]] = [
            f for fs in self.pm.hook.trtserver_stop_checkers(request=request, context=context) if fs for f in fs]
        stop_strings = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        if stop_strings:
            stops.insert(0, lambda: StopStrings(stop_strings))
        response_id = f"cmpl-{request.request_id or context.request_id}"
        engine_id = new_request_id()  # clients may reuse X-Request-Id; engine ids must be unique
        priority = params.engine_priority(request, tier.priority)
        engine_requests = [
            GenerationRequest(
                request_id=f"{engine_id}-{i}",
                prompt_token_ids=prompt.token_ids,
                sampling=sampling,
                n=width,
                priority=priority,
                adapter=request.peft,
                guided=guided,
                guide_spec=guide[0] if guide else None,
                guide_backend=guide[1] if guide else None,
                logits_processors=processors,
            )
            for i, prompt in enumerate(prompts)
        ]
        check = getattr(self.engine, "check", None)
        if check is not None:
            for engine_request in engine_requests:
                for param, reason in check(engine_request):
                    raise Unsupported(reason, param=_sent_param(request, param))
        return Prepared(request, context, response_id, int(time.time()), prompts, engine_requests, stops,
                        counted=tier.counted, sequences=sequences)

    async def _guided_decoder(self, spec: GuideSpec, backend: str) -> GuidedDecoder:
        if not self.info.capabilities.guided_decoding:
            raise Unsupported(f"this engine ({self.info.backend}) does not support guided decoding",
                              param="guided_decoding_backend")
        context = GuideContext(self.tokenizer, self.info.vocab_size, self.info.eos_token_ids,
                               self.config.guided_compile_timeout_s)
        decoder = await asyncio.to_thread(self.pm.hook.trtserver_guided_decoder, spec=spec, backend=backend,
                                          context=context)
        if decoder is None:
            raise InvalidRequest(f"guided decoding backend {backend!r} is not available on this server "
                                 "(install the trtserver-guided plugin with that backend's extra)",
                                 param="guided_decoding_backend")
        return decoder  # type: ignore[no-any-return]

    # --- running ---------------------------------------------------------------------------

    def _new_choice(self, prepared: Prepared, prompt_index: int, seq_index: int) -> ChoiceState:
        request = prepared.request
        decoder = IncrementalDecoder(self.tokenizer, skip_special_tokens=request.skip_special_tokens,
                                     spaces_between_special_tokens=request.spaces_between_special_tokens)
        stream = TextStream(decoder, [factory() for factory in prepared.stop_factories],
                            include_stop_str_in_output=request.include_stop_str_in_output)
        prompt = prepared.prompts[prompt_index]
        echo = ""
        if request.echo:
            echo = prompt.text if prompt.text is not None else self.tokenizer.decode(
                prompt.token_ids, skip_special_tokens=request.skip_special_tokens)
        return ChoiceState(prompt_index, seq_index, stream, len(prompt.token_ids), echo_text=echo,
                           eos_token_ids=() if request.ignore_eos else self.info.eos_token_ids)

    def _choices(self, prepared: Prepared) -> dict[tuple[int, int], ChoiceState]:
        width = prepared.request.best_of or prepared.request.n
        return {(p, s): self._new_choice(prepared, p, s)
                for p in range(len(prepared.prompts)) for s in range(width)}

    def stream(self, prepared: Prepared) -> AsyncGenerator[CompletionResponse, None]:
        """What a streaming client gets: chunks, then a usage chunk when asked."""
        options = prepared.request.stream_options
        return self._chunks(prepared, self._choices(prepared),
                            usage_chunk=options is not None and options.include_usage)

    async def _chunks(self, prepared: Prepared, choices: dict[tuple[int, int], ChoiceState], *,
                      usage_chunk: bool = False) -> AsyncGenerator[CompletionResponse, None]:
        """Chunks, one choice each, then the usage chunk if asked; closing this early aborts the
        engine requests."""
        request = prepared.request
        namer = TokenNamer(self.tokenizer, request.return_tokens_as_token_ids)
        options = request.stream_options
        continuous = options is not None and options.include_usage and options.continuous_usage_stats
        # best_of > n and beam search are collected and ranked: keep every sequence apart until then
        stride = request.n if request.stream else (request.best_of or request.n)
        # the engine sends a prompt's logprobs once (with its first sequence); every choice echoes them
        prompt_scores: dict[int, PromptScores] = {}

        def on_delta(prompt_index: int, delta: SequenceOutput) -> tuple[CompletionResponse | None, bool]:
            """The chunk one engine delta makes (None: nothing to send), and whether its choice just ended."""
            if delta.prompt_token_logprobs is not None:
                prompt_scores[prompt_index] = PromptScores(
                    delta.prompt_token_logprobs, delta.prompt_logprobs or [None] * len(delta.prompt_token_logprobs))
            choice = choices.get((prompt_index, delta.index))
            if choice is None or choice.finished:
                return None, False
            piece = choice_piece(request, prepared.prompts[prompt_index].token_ids, choice, delta, namer, stride,
                                 prompt_scores.get(prompt_index))
            if choice.finished and delta.finish_reason is None:  # we stopped it (stop string): free it now
                self.engine.abort(prepared.engine_requests[prompt_index].request_id, delta.index)
            if piece is None:
                return None, choice.finished
            if prepared.first_token_at is None:
                prepared.first_token_at = time.monotonic()
            usage = Usage(choice.prompt_tokens, choice.completion_tokens,
                          choice.prompt_tokens + choice.completion_tokens) if continuous else None
            return self._chunk(prepared, [piece], usage), choice.finished

        remaining = len(choices)
        end_pulled: Callable[[], None] | None = None  # set once deltas are pushed to ``take``
        push_tried = False
        failure: BaseException | None = None

        def take(delta: SequenceOutput) -> bool:
            """The engine's dispatch offers each delta here first, while this generator waits for its
            next one: a streamed token is shaped and written with no task switch and no generator
            frames. Final deltas, and any while the client's socket is backed up, are declined and
            come through the loop below."""
            nonlocal remaining, failure
            sink = prepared.sink
            if sink is None or delta.finish_reason is not None or not sink.writable() or end_pulled is None:
                return False
            try:
                chunk, ended = on_delta(0, delta)
                if chunk is not None:
                    sink.write(chunk)
            except BaseException as exc:  # raised by the reader, never into the engine's dispatch
                failure = exc
                end_pulled()
                return True
            remaining -= ended
            if remaining == 0:
                end_pulled()
            return True

        try:
            async with aclosing(self._engine_outputs(prepared)) as outputs:
                async for prompt_index, delta in outputs:
                    chunk, ended = on_delta(prompt_index, delta)
                    remaining -= ended
                    if chunk is not None:
                        yield chunk
                    if remaining == 0:
                        break
                    if not push_tried and prepared.sink is not None:
                        push_tried = True
                        end_pulled = self._push_to(prepared, take)
            if failure is not None:
                raise failure
            prepared.completed = True
        finally:
            prepared.usage = self.usage(prepared, choices.values())
        if usage_chunk:
            yield self._chunk(prepared, [], prepared.usage)

    def _push_to(self, prepared: Prepared, take: DeltaSink) -> Callable[[], None] | None:
        """Deltas handed to ``take`` as they arrive, where the engine can (``push_to``) and the
        request has one engine stream; returns the function that ends that stream."""
        push_to = getattr(self.engine, "push_to", None)
        if push_to is None or len(prepared.engine_requests) != 1:
            return None
        return push_to(prepared.engine_requests[0].request_id, take)  # type: ignore[no-any-return]

    def _engine_outputs(self, prepared: Prepared) -> AsyncGenerator[tuple[int, SequenceOutput], None]:
        """Every prompt's engine stream, interleaved as deltas arrive (``max_tokens=0`` too: engines
        answer it with an empty "length" delta per sequence, after their own checks)."""
        return merge_streams([self.engine.generate(r) for r in prepared.engine_requests])

    def _chunk(self, prepared: Prepared, choices: list[CompletionChoice], usage: Usage | None) -> CompletionResponse:
        return CompletionResponse(id=prepared.response_id, created=prepared.created, model=self.model_name,
                                  choices=choices, usage=usage, system_fingerprint=self.system_fingerprint,
                                  service_tier=prepared.context.service_tier or UNSET)

    @staticmethod
    def usage(prepared: Prepared, choices: Iterable[ChoiceState]) -> Usage:
        prompt_tokens = sum(len(p.token_ids) for p in prepared.prompts)
        completion = sum(c.completion_tokens for c in choices)
        return Usage(prompt_tokens, completion, prompt_tokens + completion)

    def wants_response_ready(self) -> bool:
        return bool(self.pm.hook.trtserver_response_ready.get_hookimpls())

    async def response_ready(self, prepared: Prepared, response: CompletionResponse) -> None:
        """Fire ``trtserver_response_ready``; a failing plugin is logged, never the client's problem."""
        try:
            for result in self.pm.hook.trtserver_response_ready(request=prepared.request, response=response,
                                                               context=prepared.context):
                await await_me_maybe(result)
        except Exception:
            log.exception("response_ready_hook_failed")

    # --- collecting ------------------------------------------------------------------------

    async def complete(self, prepared: Prepared) -> CompletionResponse:
        """The non-streaming response: the same chunks, joined; best_of and beams ranked here."""
        request = prepared.request
        states = self._choices(prepared)
        merged = ChoiceMerger()
        async with aclosing(self._chunks(prepared, states)) as chunks:
            async for chunk in chunks:
                merged.add(chunk)
        width = request.best_of or request.n
        if width > request.n or request.use_beam_search:
            merged.keep_best(lambda p, s: states[(p, s)].score(), len(prepared.prompts), request.n, width)
        if request.logprobs is None:
            for choice in merged.choices.values():
                choice.logprobs = None
        return CompletionResponse(id=prepared.response_id, created=prepared.created, model=self.model_name,
                                  choices=merged.ordered(), usage=prepared.usage,
                                  system_fingerprint=self.system_fingerprint,
                                  service_tier=prepared.context.service_tier or UNSET)


def _sent_param(request: CompletionRequest, param: str) -> str:
    """An engine names a refused feature generically; blame the field the client actually sent."""
    if param.startswith("guided") or param in ("structured_outputs", "response_format"):
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                     "response_format"):
            if getattr(request, name) is not None:
                return name
    if param in ("n", "best_of"):
        return "best_of" if request.best_of is not None and request.best_of > 1 else "n"
    return param


def new_request_id() -> str:
    return uuid.uuid4().hex
