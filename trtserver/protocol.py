"""Wire objects: one msgspec Struct per JSON object of the completions and chat APIs.

Covers OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` plus the vLLM, OctoAI and Nebius
extensions (see ``docs/api.md``); ``GenerationFields`` holds what both take. Imports neither torch
nor aiohttp nor tensorrt_llm. Field-level ranges live in ``Meta``; rules that involve several
fields live in each request's ``check()``, which raises ``FieldError``; the server turns either
into a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

import msgspec
from msgspec import UNSET, Meta, UnsetType

Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
PositiveInt = Annotated[int, Meta(ge=1)]

ServiceTier = Literal["auto", "default", "flex", "over-limit", "no-limit"]


class FieldError(ValueError):
    """A cross-field rule failed; ``param`` names the field to blame."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(msgspec.Struct, forbid_unknown_fields=False):
    include_usage: bool = True
    continuous_usage_stats: bool = False


class JsonSchemaFormat(msgspec.Struct):
    name: str | None = None
    description: str | None = None
    schema_: Any = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(msgspec.Struct):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct):
    """vLLM's newer ``structured_outputs`` object (one kind of constraint at a time)."""

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    backend: str | None = None  # trtserver extension: per-request backend choice


class GenerationFields(msgspec.Struct, kw_only=True):
    """The fields both APIs take: sampling, stops, guided decoding, tiers, adapters."""

    # --- OpenAI ---
    model: str | None = None
    frequency_penalty: Penalty | None = 0.0
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    max_tokens: NonNegativeInt | None = None
    n: PositiveInt = 1
    presence_penalty: Penalty | None = 0.0
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    echo: bool = False

    # --- vLLM sampling extensions ---
    use_beam_search: bool = False
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    # beyond these a beam's score overflows or flips sign for any length
    length_penalty: Annotated[float, Meta(ge=-10.0, le=10.0)] = 1.0
    early_stopping: bool | Literal["never"] = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: NonNegativeInt = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: PositiveInt | None = None
    allowed_token_ids: list[TokenId] | None = None
    prompt_logprobs: NonNegativeInt | None = None
    bad_words: list[str] | None = None

    # --- vLLM extra parameters ---
    priority: int = 0
    request_id: str | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    logits_processors: list[Any] | None = None

    # --- vLLM guided decoding (pre-0.11) and structured outputs ---
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: StructuredOutputs | None = None

    # --- OctoAI ---
    peft: str | None = None
    log_prompt: bool = False

    # --- Nebius ---
    service_tier: ServiceTier | None = None
    extra_body: dict[str, Any] | None = None

    def check_common(self) -> None:
        """Rules between the shared fields; raises FieldError."""
        if isinstance(self.stop, list) and any(s == "" for s in self.stop):
            raise FieldError("stop must not contain an empty string", "stop")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options can only be set when stream is true", "stream_options")
        if self.stream and self.use_beam_search:
            raise FieldError("beam search results cannot be streamed; set stream to false", "use_beam_search")
        if self.stream and self.prompt_logprobs:
            raise FieldError("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        if self.logit_bias:
            bad = [key for key in self.logit_bias if not _is_int_key(key)]
            if bad:
                raise FieldError(f"logit_bias keys must be integer token ids, got {bad[:5]}", "logit_bias")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise FieldError("allowed_token_ids must not be empty", "allowed_token_ids")
        if self.use_beam_search and self.early_stopping not in (True, False, "never"):
            raise FieldError("early_stopping must be true, false or \"never\"", "early_stopping")


class CompletionRequest(GenerationFields, kw_only=True):
    # --- OpenAI (legacy completions) ---
    prompt: str | list[str | Annotated[int, Meta(ge=0)] | list[TokenId]]
    best_of: Annotated[int, Meta(ge=1)] | None = None
    logprobs: NonNegativeInt | None = None
    suffix: str | None = None
    # --- vLLM ---
    add_special_tokens: bool = True
    # --- OctoAI ---
    loglikelihood: bool = False

    def check(self) -> None:
        """Rules between fields (msgspec checks each field alone); raises FieldError."""
        prompt = self.prompt
        if isinstance(prompt, str):
            pass
        elif not prompt:
            raise FieldError("prompt must not be an empty list", "prompt")
        else:
            kinds = {type(p) for p in prompt}
            if len(kinds) > 1:
                raise FieldError("prompt must be a string, a list of strings, a list of token ids, "
                                 "or a list of token-id lists, not a mixture", "prompt")
            if kinds == {list} and any(not p for p in prompt):  # type: ignore[union-attr]
                raise FieldError("prompt token-id lists must not be empty", "prompt")
        self.check_common()
        if self.best_of is not None and self.best_of < self.n:
            raise FieldError(f"best_of must be greater than or equal to n, got n={self.n} and "
                             f"best_of={self.best_of}", "best_of")
        if self.stream and not self.use_beam_search and self.best_of is not None and self.best_of > self.n:
            raise FieldError("best_of greater than n cannot be streamed; set stream to false", "best_of")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise FieldError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}",
                             "min_tokens")
        if self.max_tokens == 0 and not self.echo and not self.loglikelihood and self.prompt_logprobs is None:
            raise FieldError("max_tokens must be at least 1 unless echo is true (prompt scoring)", "max_tokens")

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list: strings, or token-id lists."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [cast("list[int]", list(prompt))]
        return cast("list[str] | list[list[int]]", list(prompt))


# --- chat -------------------------------------------------------------------------------------


class TextPart(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ImageUrlPart(msgspec.Struct, tag="image_url", tag_field="type"):
    image_url: Any = None


class InputAudioPart(msgspec.Struct, tag="input_audio", tag_field="type"):
    input_audio: Any = None


class FilePart(msgspec.Struct, tag="file", tag_field="type"):
    file: Any = None


ContentPart = TextPart | ImageUrlPart | InputAudioPart | FilePart


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str | None:
        """The content as text: a list of text parts joined (other parts are refused before this)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content


class FunctionDefinition(msgspec.Struct):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct):
    function: NamedFunction
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(GenerationFields, kw_only=True):
    # --- OpenAI ---
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    max_completion_tokens: NonNegativeInt | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # --- vLLM ---
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False

    def check(self) -> None:
        """Rules between fields; raises FieldError."""
        if not self.messages:
            raise FieldError("messages must hold at least one message", "messages")
        for message in self.messages:
            _check_message(message)
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs needs logprobs set to true", "top_logprobs")
        limit = self.completion_limit
        if limit is not None and self.min_tokens > limit:
            raise FieldError(f"min_tokens must be less than or equal to {self.limit_param}={limit}", "min_tokens")
        if limit == 0:
            raise FieldError("max_completion_tokens must be at least 1", self.limit_param)
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message and add_generation_prompt cannot both be true; set "
                             "add_generation_prompt to false", "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise FieldError("continue_final_message needs the last message to be the assistant's",
                             "continue_final_message")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) or choice == "required":
            names = [tool.function.name for tool in self.tools or []]
            if not names:
                raise FieldError("tool_choice names a tool but no tools are given", "tool_choice")
            if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
                raise FieldError(f"tool_choice names the function {choice.function.name!r}, which is not in "
                                 "tools", "tool_choice")

    @property
    def completion_limit(self) -> int | None:
        """``max_completion_tokens``, or the older ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def limit_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


def _check_message(message: ChatMessage) -> None:
    if isinstance(message.content, list):
        for part in message.content:
            if not isinstance(part, TextPart):
                raise FieldError(f"this model takes text only; a {part.__struct_config__.tag!r} content part "
                                 "cannot be served", "messages")
    if message.role == "tool" and not message.tool_call_id:
        raise FieldError("a tool message needs tool_call_id", "messages")
    if message.content is None and not (message.role == "assistant" and message.tool_calls):
        raise FieldError(f"a {message.role} message needs content", "messages")
    if message.tool_calls and message.role != "assistant":
        raise FieldError("only assistant messages carry tool_calls", "messages")


def _is_int_key(key: str) -> bool:
    try:
        int(key)
    except ValueError:
        return False
    return True


# --- tokens (vLLM's /tokenize and /detokenize) ---------------------------------------------------


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """A ``prompt`` (as completions takes it) or ``messages`` (through the chat template), not both."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("give exactly one of prompt and messages", "prompt")
        for message in self.messages or []:
            _check_message(message)
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message and add_generation_prompt cannot both be true; set "
                             "add_generation_prompt to false", "continue_final_message")


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(msgspec.Struct):
    prompt: str


# --- responses --------------------------------------------------------------------------------


class CompletionLogprobs(msgspec.Struct):
    """The legacy logprobs object. ``text_offset`` counts characters from the start of the
    returned ``text`` of the choice (so with ``echo`` from the start of the prompt)."""

    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class PromptLogprob(msgspec.Struct):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(msgspec.Struct):
    text: str
    index: int
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | UnsetType = UNSET
    loglikelihood: CompletionLogprobs | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # when the engine has a prefix cache


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    system_fingerprint: str | None
    object: Literal["text_completion"] = "text_completion"
    service_tier: str | UnsetType = UNSET


class ChatTopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class ChatResponseMessage(msgspec.Struct):
    content: str | None
    tool_calls: list[ToolCall] | UnsetType = UNSET
    role: Literal["assistant"] = "assistant"
    refusal: None = None


ChatFinishReason = Literal["stop", "length", "tool_calls", "abort"]


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None
    system_fingerprint: str | None
    object: Literal["chat.completion"] = "chat.completion"
    service_tier: str | UnsetType = UNSET


class FunctionCallDelta(msgspec.Struct, omit_defaults=True):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    index: int
    function: FunctionCallDelta
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: Literal["assistant"] | UnsetType = UNSET
    content: str | None | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None
    system_fingerprint: str | None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    service_tier: str | UnsetType = UNSET


class ModelCard(msgspec.Struct):
    id: str
    created: int
    object: Literal["model"] = "model"
    owned_by: str = "trtserver"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorDetail


REQUEST_FIELDS: frozenset[str] = frozenset(f.encode_name for f in msgspec.structs.fields(CompletionRequest))
CHAT_REQUEST_FIELDS: frozenset[str] = frozenset(f.encode_name for f in msgspec.structs.fields(ChatCompletionRequest))

request_decoder = msgspec.json.Decoder(CompletionRequest)
chat_request_decoder = msgspec.json.Decoder(ChatCompletionRequest)
encoder = msgspec.json.Encoder()
