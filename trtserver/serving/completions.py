"""The completions API's shaper: a ``CompletionRequest`` becomes prompts; pieces become its chunks."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from msgspec import UNSET

from trtserver.guided import GuideSpec, guide_spec_from_request
from trtserver.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from trtserver.serving import checks
from trtserver.serving.checks import Plan, PromptInput
from trtserver.serving.choices import ChoiceMerger, TokenNamer, choice_piece
from trtserver.serving.core import Prepared, Service


class CompletionsApi:
    name = "completions"
    id_prefix = "cmpl"

    def plan(self, request: CompletionRequest) -> Plan:
        wants_prompt = request.loglikelihood or (request.echo and request.logprobs is not None)
        prompt_logprobs = request.prompt_logprobs
        if wants_prompt:
            prompt_logprobs = max(prompt_logprobs or 0, request.logprobs or 0)
        return Plan(logprobs=request.logprobs, width=request.best_of or request.n, n=request.n,
                    prompt_count=len(request.prompts), max_tokens=request.max_tokens, prompt_logprobs=prompt_logprobs)

    def prepare_state(self, request: CompletionRequest, service: Service) -> None:
        return None

    def prompts(self, request: CompletionRequest, service: Service) -> list[PromptInput]:
        texts = [p for p in request.prompts if isinstance(p, str)]
        checks.check_prompt_bytes(texts, request.truncate_prompt_tokens, service.context_length,
                                  service.longest_token_bytes, param="prompt")
        return checks.tokenize_prompts(request, service.tokenizer, service.info)

    def guide(self, request: CompletionRequest, state: Any) -> tuple[GuideSpec, str] | None:
        return guide_spec_from_request(request)

    def _echo(self, request: CompletionRequest, service: Service):  # type: ignore[no-untyped-def]
        if not request.echo:
            return None
        return lambda prompt: prompt.text if prompt.text is not None else service.tokenizer.decode(
            prompt.token_ids, skip_special_tokens=request.skip_special_tokens)

    async def chunks(self, prepared: Prepared[CompletionRequest], service: Service
                     ) -> AsyncGenerator[CompletionResponse, None]:
        """Chunks, one choice each, then the usage chunk if asked."""
        request = prepared.request
        choices = service.new_choices(prepared, echo=self._echo(request, service))
        namer = TokenNamer(service.tokenizer, request.return_tokens_as_token_ids)
        options = request.stream_options
        continuous = options is not None and options.include_usage and options.continuous_usage_stats
        # best_of > n and beam search are collected and ranked: keep every sequence apart until then
        stride = request.n if request.stream else prepared.plan.width
        async with aclosing(service.pieces(prepared, choices)) as pieces:
            async for piece in pieces:
                out = choice_piece(request, prepared.prompts[piece.choice.prompt_index].token_ids, piece.choice,
                                   piece.delta, piece.text, piece.first, namer, stride, piece.prompt_scores)
                if out is None:
                    continue
                choice = piece.choice
                usage = choice.usage() if continuous else None
                yield self.response(prepared, service, [out], usage)
        if request.stream and options is not None and options.include_usage:
            yield self.response(prepared, service, [], prepared.usage)

    @staticmethod
    def response(prepared: Prepared[Any], service: Service, choices: list[CompletionChoice],
                 usage: Usage | None) -> CompletionResponse:
        return CompletionResponse(id=prepared.response_id, created=prepared.created, model=service.model_name,
                                  choices=choices, usage=usage, system_fingerprint=service.system_fingerprint,
                                  service_tier=prepared.context.service_tier or UNSET)

    def joiner(self, prepared: Prepared[CompletionRequest], service: Service) -> CompletionJoiner:
        return CompletionJoiner(prepared, service)


class CompletionJoiner:
    """Chunks joined into the non-streaming response; best_of and beams ranked here."""

    def __init__(self, prepared: Prepared[CompletionRequest], service: Service) -> None:
        self.prepared = prepared
        self.service = service
        self.merged = ChoiceMerger()
        self.usage: Usage | None = None

    def add(self, chunk: CompletionResponse) -> None:
        self.merged.add(chunk)
        self.usage = chunk.usage or self.usage

    def response(self) -> CompletionResponse:
        prepared, request, merged = self.prepared, self.prepared.request, self.merged
        plan = prepared.plan
        if not request.stream:
            if plan.width > plan.n or request.use_beam_search:
                states = prepared.choices
                merged.keep_best(lambda p, s: states[(p, s)].score(), len(prepared.prompts), plan.n, plan.width)
            if request.logprobs is None:  # collected only to rank best_of
                for choice in merged.choices.values():
                    choice.logprobs = None
        return CompletionsApi.response(prepared, self.service, merged.ordered(), self.usage or prepared.usage)
