"""The chat API's shaper: messages through the chat template become one prompt; pieces become
``chat.completion.chunk`` deltas (role, content, tool calls, logprobs), and the response is those
chunks joined.

Tools: ``tool_choice`` "none" leaves them out; a named function constrains the output to its
parameters' schema and "required" to a list of calls (both through guided decoding); "auto" hands
the model's own text to the tool-call parser the server was started with.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import pluggy
from msgspec import UNSET

from trtserver.chat_template import ChatTemplate, require_chat_template, resolve_chat_template, template_token_ids
from trtserver.config import ServerConfig
from trtserver.engine.base import Engine
from trtserver.errors import InvalidRequest
from trtserver.guided import DEFAULT_BACKEND, GuideSpec, guide_spec_from_request
from trtserver.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTool,
    ChatTopLogprob,
    FunctionCall,
    FunctionCallDelta,
    NamedToolChoice,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from trtserver.serving import checks
from trtserver.serving.checks import Plan, PromptInput
from trtserver.serving.choices import TokenNamer, clamp
from trtserver.serving.core import Piece, Prepared, Service
from trtserver.tool_calls import (
    ContentDelta,
    NamedToolParser,
    RequiredToolParser,
    ToolCallArguments,
    ToolCallParser,
    ToolCallStart,
    ToolParserFactory,
    ToolParserMissing,
    named_tool_schema,
    required_tools_schema,
    tool_parser_factory,
)

# what the client sent, for a check that speaks of our internal names
CHAT_NAMES = {"logprobs": "top_logprobs", "prompt": "messages"}


@dataclass(frozen=True, slots=True)
class ToolMode:
    """How a request's tools shape its output."""

    kind: Literal["text", "named", "required", "auto"]
    function: str | None = None  # the named function
    parser: ToolParserFactory | None = None  # auto


class ChatApi:
    name = "chat"
    id_prefix = "chatcmpl"

    @staticmethod
    def start_up(config: ServerConfig, pm: pluggy.PluginManager, engine: Engine) -> dict[str, Any]:
        """What chat needs from start-up: the template, and the tool-call parser the server names
        (an unknown name or a template that does not compile stops start-up)."""
        return {
            "chat_template": resolve_chat_template(config, pm, engine.tokenizer),
            "tool_parser": tool_parser_factory(pm, config.tool_call_parser) if config.tool_call_parser else None,
        }

    def plan(self, request: ChatCompletionRequest) -> Plan:
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        names = dict(CHAT_NAMES, max_tokens=request.limit_param)
        return Plan(logprobs=logprobs, width=request.n, n=request.n, prompt_count=1,
                    max_tokens=request.completion_limit, prompt_logprobs=request.prompt_logprobs, names=names)

    def prepare_state(self, request: ChatCompletionRequest, service: Service) -> ToolMode:
        choice = request.tool_choice
        if not request.tools or choice == "none":
            return ToolMode("text")
        if isinstance(choice, NamedToolChoice):
            return ToolMode("named", function=choice.function.name)
        if choice == "required":
            return ToolMode("required")
        parser = service.extras.get("tool_parser")
        if parser is None:
            raise ToolParserMissing()
        return ToolMode("auto", parser=parser)

    def prompts(self, request: ChatCompletionRequest, service: Service) -> list[PromptInput]:
        tools = request.tools if request.tool_choice != "none" else None
        prompt = render_messages(service, request.messages, tools=tools, template_text=request.chat_template,
                                 add_generation_prompt=request.add_generation_prompt,
                                 continue_final_message=request.continue_final_message,
                                 kwargs=request.chat_template_kwargs, add_special_tokens=request.add_special_tokens)
        if request.truncate_prompt_tokens is not None:
            prompt.token_ids = prompt.token_ids[-request.truncate_prompt_tokens:]
        return [prompt]

    def guide(self, request: ChatCompletionRequest, mode: ToolMode) -> tuple[GuideSpec, str] | None:
        asked = guide_spec_from_request(request)
        if mode.kind not in ("named", "required"):
            return asked
        if asked is not None:
            raise InvalidRequest("a named or required tool_choice constrains the output itself; it cannot be "
                                 "combined with response_format or guided decoding", param="tool_choice")
        tools = [msgspec.to_builtins(tool) for tool in request.tools or []]
        if mode.kind == "named":
            schema = named_tool_schema(tools, mode.function or "")
        else:
            schema = required_tools_schema(tools, parallel=request.parallel_tool_calls)
        backend = request.guided_decoding_backend or DEFAULT_BACKEND
        return GuideSpec("json", json.dumps(schema), request.guided_whitespace_pattern), backend

    async def chunks(self, prepared: Prepared[ChatCompletionRequest], service: Service
                     ) -> AsyncGenerator[ChatCompletionChunk, None]:
        request = prepared.request
        last = request.messages[-1]
        echo_text = (last.text() or "") if request.echo and last.role == "assistant" else ""
        choices = service.new_choices(prepared, echo=(lambda _: echo_text) if echo_text else None)
        mode: ToolMode = prepared.api_state
        tools = [msgspec.to_builtins(tool) for tool in request.tools or []]
        outs = {key: _ChoiceOutput.for_mode(mode, tools) for key in choices}
        logprobs = _LogprobMaker(service, prepared.plan.logprobs) if request.logprobs else None
        options = request.stream_options
        continuous = options is not None and options.include_usage and options.continuous_usage_stats
        async with aclosing(service.pieces(prepared, choices)) as pieces:
            async for piece in pieces:
                choice = piece.choice
                out = outs[(choice.prompt_index, choice.seq_index)]
                text = (choice.echo_text + piece.text) if piece.first else piece.text
                delta = out.delta(text, piece.first, choice.finished)
                lps = logprobs.of(piece) if logprobs is not None else None
                if not piece.first and not choice.finished and lps is None and delta == ChatDelta():
                    continue
                reason = choice.finish_reason if choice.finished else None
                if reason == "stop" and out.calls:
                    reason = "tool_calls"
                usage = choice.usage() if continuous else None
                part = ChatChunkChoice(index=choice.seq_index, delta=delta, logprobs=lps,
                                       finish_reason=reason,  # type: ignore[arg-type]
                                       stop_reason=choice.stop_reason if choice.finished else None)
                yield self.chunk(prepared, service, [part], usage)
        if request.stream and options is not None and options.include_usage:
            yield self.chunk(prepared, service, [], prepared.usage)

    @staticmethod
    def chunk(prepared: Prepared[Any], service: Service, choices: list[ChatChunkChoice],
              usage: Usage | None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=prepared.response_id, created=prepared.created, model=service.model_name,
                                   choices=choices, usage=usage, system_fingerprint=service.system_fingerprint,
                                   service_tier=prepared.context.service_tier or UNSET)

    def joiner(self, prepared: Prepared[ChatCompletionRequest], service: Service) -> ChatJoiner:
        return ChatJoiner(prepared, service)


def render_messages(service: Service, messages: list[ChatMessage], *, tools: list[ChatTool] | None,
                    template_text: str | None, add_generation_prompt: bool, continue_final_message: bool,
                    kwargs: dict[str, Any] | None, add_special_tokens: bool) -> PromptInput:
    """Messages through the chat template (the request's, else the server's), then tokenized with
    the template's special tokens as special tokens."""
    if template_text is not None:
        template = ChatTemplate.for_tokenizer(template_text, service.tokenizer)
    else:
        template = require_chat_template(service.extras.get("chat_template"))
    text = template.render([msgspec.to_builtins(m) for m in messages],
                           tools=[msgspec.to_builtins(tool) for tool in tools] if tools else None,
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, kwargs=kwargs)
    checks.check_prompt_bytes([text], None, service.context_length, service.longest_token_bytes, param="messages")
    ids = template_token_ids(text, service.tokenizer)
    bos = service.tokenizer.bos_token_id
    if add_special_tokens and bos is not None and (not ids or ids[0] != bos):  # vLLM's flag, BOS still once
        ids.insert(0, bos)
    return PromptInput(ids, text)


@dataclass(slots=True)
class _ChoiceOutput:
    """One choice's text turned into content and tool-call deltas, per the request's tool mode."""

    parser: ToolCallParser | None
    calls: int = 0  # tool calls started

    @classmethod
    def for_mode(cls, mode: ToolMode, tools: list[dict[str, Any]]) -> _ChoiceOutput:
        if mode.kind == "named":
            return cls(NamedToolParser(mode.function or ""))
        if mode.kind == "required":
            return cls(RequiredToolParser())
        if mode.kind == "auto" and mode.parser is not None:
            return cls(mode.parser(tools))
        return cls(None)

    def delta(self, text: str, first: bool, finished: bool) -> ChatDelta:
        delta = ChatDelta(role="assistant") if first else ChatDelta()
        if self.parser is None:
            if text or first:
                delta.content = text
            return delta
        events = self.parser.feed(text) if text else []
        if finished:
            events += self.parser.finish()
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        for event in events:
            if isinstance(event, ContentDelta):
                content.append(event.text)
            elif isinstance(event, ToolCallStart):
                self.calls += 1
                calls.append(ToolCallDelta(index=event.index, id=event.id, type="function",
                                           function=FunctionCallDelta(name=event.name, arguments="")))
            elif isinstance(event, ToolCallArguments):
                previous = calls[-1].function if calls and calls[-1].index == event.index else None
                if previous is not None and isinstance(previous.arguments, str):
                    # one entry per call in a delta: clients merge fragments across deltas, not within one
                    previous.arguments += event.text
                else:
                    calls.append(ToolCallDelta(index=event.index,
                                               function=FunctionCallDelta(arguments=event.text)))
        if content or (first and not calls):
            delta.content = "".join(content)
        if calls:
            delta.tool_calls = calls
        return delta


class _LogprobMaker:
    """``logprobs.content`` entries for a piece's tokens: the token, its bytes, and its top alternatives."""

    def __init__(self, service: Service, top: int | None) -> None:
        self.name: Callable[[int], str] = TokenNamer(service.tokenizer, False)
        self.token_bytes = service.tokenizer.token_bytes
        self.top = top or 0

    def _bytes(self, token_id: int) -> list[int] | None:
        table = self.token_bytes
        return list(table[token_id]) if table is not None and token_id < len(table) else None

    def of(self, piece: Piece) -> ChatLogprobs | None:
        delta = piece.delta
        if delta.logprobs is None or not delta.token_ids:
            return None
        entries = []
        for i, token_id in enumerate(piece.choice.visible_tokens(delta)):  # a final EOS is not content
            tops = delta.top_logprobs[i] if delta.top_logprobs is not None else []
            entries.append(ChatTokenLogprob(
                token=self.name(token_id), logprob=clamp(delta.logprobs[i]), bytes=self._bytes(token_id),
                top_logprobs=[ChatTopLogprob(self.name(alt), clamp(lp), self._bytes(alt))
                              for alt, lp in (tops or [])[:self.top]]))
        return ChatLogprobs(content=entries)


class ChatJoiner:
    """Chunks joined into one ``chat.completion``."""

    def __init__(self, prepared: Prepared[ChatCompletionRequest], service: Service) -> None:
        self.prepared = prepared
        self.service = service
        self.choices: dict[int, _Joined] = {}
        self.usage: Usage | None = None

    def add(self, chunk: ChatCompletionChunk) -> None:
        self.usage = chunk.usage or self.usage
        for part in chunk.choices:
            joined = self.choices.setdefault(part.index, _Joined())
            delta = part.delta
            if isinstance(delta.content, str):
                joined.content.append(delta.content)
            for call in delta.tool_calls or []:
                if call.id is not UNSET:
                    joined.calls[call.index] = [str(call.id), str(call.function.name or ""), ""]
                if isinstance(call.function.arguments, str):
                    joined.calls[call.index][2] += call.function.arguments
            if part.logprobs is not None and part.logprobs.content:
                joined.logprobs.extend(part.logprobs.content)
            if part.finish_reason is not None:
                joined.finish_reason = part.finish_reason
                joined.stop_reason = part.stop_reason

    def response(self) -> ChatCompletionResponse:
        prepared = self.prepared
        want_logprobs = prepared.request.logprobs
        choices = []
        for index in sorted(self.choices):
            joined = self.choices[index]
            calls = [ToolCall(id=i, function=FunctionCall(name=n, arguments=a))
                     for i, n, a in (joined.calls[k] for k in sorted(joined.calls))]
            content = "".join(joined.content)
            message = ChatResponseMessage(content=content if content or not calls else None,
                                          tool_calls=calls if calls else UNSET)
            choices.append(ChatChoice(index=index, message=message,
                                      logprobs=ChatLogprobs(content=joined.logprobs) if want_logprobs else None,
                                      finish_reason=joined.finish_reason,  # type: ignore[arg-type]
                                      stop_reason=joined.stop_reason))
        return ChatCompletionResponse(id=prepared.response_id, created=prepared.created,
                                      model=self.service.model_name, choices=choices,
                                      usage=self.usage or prepared.usage,
                                      system_fingerprint=self.service.system_fingerprint,
                                      service_tier=prepared.context.service_tier or UNSET)


@dataclass(slots=True)
class _Joined:
    content: list[str] = field(default_factory=list)
    calls: dict[int, list[str]] = field(default_factory=dict)
    logprobs: list[ChatTokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
