"""Every request check that needs the model, for both APIs, and the sampling they lead to.

Checks that need no model live in ``protocol.py``; here are the ones that need the tokenizer,
the context length, the vocabulary, the server's limits and the engine's capabilities. Engines
keep only their invariants. A check names the field the client sent (``Plan.blame``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from trtserver.config import ServerConfig
from trtserver.engine.base import EngineInfo, Priority, SamplingParams
from trtserver.errors import ContextLengthExceeded, InvalidRequest, NotFound, Unsupported
from trtserver.protocol import CompletionRequest, GenerationFields
from trtserver.text import check_stop_strings
from trtserver.tokenizer import Tokenizer

# more stop ids than this is a mistake, and a whole vocabulary of them leaves nothing to sample
MAX_STOP_TOKEN_IDS = 1024

# request fields that parse and validate but that this build does not implement yet
NOT_IMPLEMENTED: dict[str, str] = {
    "logits_processors": "logits processors by name are not supported; install a plugin that "
    "implements trtserver_logits_processors instead",
}


@dataclass(slots=True)
class PromptInput:
    token_ids: list[int]
    text: str | None  # the prompt as text when the client sent text (None for token ids)


@dataclass(frozen=True, slots=True)
class Plan:
    """A request as the core sees it, whichever API it came through."""

    logprobs: int | None  # alternatives per generated token; None: no logprobs at all
    width: int  # sequences generated per prompt (best_of, beams or n)
    n: int  # choices returned per prompt
    prompt_count: int
    max_tokens: int | None  # None: the server's default, bounded by the context
    # prompt logprobs the response needs (completions' echo + logprobs, loglikelihood, prompt_logprobs)
    prompt_logprobs: int | None = None
    # our name of a field -> the field the client sent it as ("logprobs" -> "top_logprobs" in chat)
    names: Mapping[str, str] = field(default_factory=dict)
    adapter: str | None = None  # the LoRA adapter: ``peft``, or an adapter's name as ``model``

    def blame(self, param: str) -> str:
        return self.names.get(param, param)


def check_model(request: GenerationFields, served_name: str, adapters: Callable[[], list[str]] | None = None
                ) -> str | None:
    """The LoRA adapter the request runs with: its ``peft``, or (as vLLM allows) an adapter named as ``model``."""
    if request.model is None or request.model == served_name:
        return request.peft
    if adapters is not None and request.model in adapters():
        if request.peft is not None and request.peft != request.model:
            raise InvalidRequest(f"model names the adapter `{request.model}` and peft names `{request.peft}`; "
                                 "name one", param="peft")
        return request.model
    raise NotFound(f"The model `{request.model}` does not exist.", param="model")


def check_limits(request: GenerationFields, plan: Plan, config: ServerConfig, info: EngineInfo) -> None:
    for name, message in NOT_IMPLEMENTED.items():
        if getattr(request, name) not in (None, False, [], 0):
            raise Unsupported(message, param=name)
    caps = info.capabilities
    max_logprobs = min(config.max_logprobs, caps.max_logprobs) if caps.max_logprobs else config.max_logprobs
    if plan.logprobs is not None and plan.logprobs > max_logprobs:
        raise InvalidRequest(f"{plan.blame('logprobs')} must be at most {max_logprobs}, got {plan.logprobs}",
                             param=plan.blame("logprobs"))
    if request.prompt_logprobs is not None and request.prompt_logprobs > max_logprobs:
        raise InvalidRequest(f"prompt_logprobs must be at most {max_logprobs}, got {request.prompt_logprobs}",
                             param="prompt_logprobs")
    if plan.n > config.max_n:
        raise InvalidRequest(f"n must be at most {config.max_n}, got {plan.n}", param="n")
    if plan.width > plan.n and plan.width > config.max_best_of:
        raise InvalidRequest(f"best_of must be at most {config.max_best_of}, got {plan.width}",
                             param="best_of")
    stops = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
    if len(stops) > config.max_stop_sequences:
        raise InvalidRequest(f"stop may hold at most {config.max_stop_sequences} sequences, got {len(stops)}",
                             param="stop")
    check_stop_strings(stops, param="stop")
    if plan.prompt_count > config.max_prompts:
        raise InvalidRequest(f"at most {config.max_prompts} prompts per request, got {plan.prompt_count}",
                             param="prompt")
    if plan.width > 1 and not caps.multiple_sequences:
        raise Unsupported(f"this engine ({info.backend}) cannot generate several sequences per prompt",
                          param="best_of" if plan.width > plan.n else "n")
    if request.use_beam_search and not caps.beam_search:
        raise Unsupported(f"this engine ({info.backend}) does not support beam search", param="use_beam_search")
    if plan.prompt_logprobs is not None and not caps.prompt_logprobs:
        raise Unsupported(f"this engine ({info.backend}) cannot return prompt logprobs (a TensorRT-LLM engine "
                          "needs gather_context_logits at build time)",
                          param="prompt_logprobs" if request.prompt_logprobs is not None else "echo")
    if request.stop_token_ids is not None and len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got "
                             f"{len(request.stop_token_ids)}", param="stop_token_ids")
    if plan.adapter is not None and not caps.adapters:
        raise Unsupported(f"LoRA adapters are not enabled on this server ({info.backend} engine); start it with "
                          "--adapters-dir", param="peft")
    if request.priority != 0 and not caps.priority:
        raise Unsupported(f"this engine ({info.backend}) does not support priority", param="priority")


def check_prompt_bytes(texts: list[str], truncate: int | None, context_length: int, longest_token_bytes: int,
                       param: str) -> None:
    """Refuse, before tokenizing it, a text so long that it cannot fit the context whatever its tokens."""
    if truncate is not None or not longest_token_bytes:
        return
    limit = context_length * longest_token_bytes
    for text in texts:
        if len(text) > limit or len(text.encode()) > limit:  # a character is at least one byte
            raise ContextLengthExceeded(
                f"This model's maximum context length is {context_length} tokens. However, your prompt is "
                f"{len(text.encode())} bytes long, more than that many tokens can hold.", param=param)


def tokenize_prompts(request: CompletionRequest, tokenizer: Tokenizer, info: EngineInfo) -> list[PromptInput]:
    prompts: list[PromptInput] = []
    fim = tokenizer.fim_token_ids if request.suffix is not None else None
    if request.suffix is not None and fim is None:
        raise Unsupported(f"suffix needs a model with fill-in-the-middle tokens; {info.model_name} has none",
                          param="suffix")
    for prompt in request.prompts:
        if isinstance(prompt, str):
            if fim is not None:
                prefix_id, suffix_id, middle_id = fim
                ids = [prefix_id, *tokenizer.encode(prompt, add_special_tokens=False), suffix_id,
                       *tokenizer.encode(request.suffix or "", add_special_tokens=False), middle_id]
                if request.add_special_tokens and tokenizer.add_bos_token and tokenizer.bos_token_id is not None:
                    ids.insert(0, tokenizer.bos_token_id)
            else:
                ids = tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens)
            prompts.append(PromptInput(ids, prompt))
        else:
            bad = [t for t in prompt if t >= info.vocab_size]
            if bad:
                raise InvalidRequest(f"prompt token ids {bad[:5]} are outside the vocabulary (size "
                                     f"{info.vocab_size})", param="prompt")
            if fim is not None:
                raise Unsupported("suffix needs a text prompt", param="suffix")
            prompts.append(PromptInput(list(prompt), None))
        if request.truncate_prompt_tokens is not None:
            prompts[-1].token_ids = prompts[-1].token_ids[-request.truncate_prompt_tokens:]
        if not prompts[-1].token_ids:
            raise InvalidRequest("prompt is empty after tokenization", param="prompt")
    return prompts


def resolve_max_tokens(plan: Plan, prompts: list[PromptInput], config: ServerConfig, info: EngineInfo) -> int:
    context = info.context_length
    if config.max_model_len is not None:
        context = min(context, config.max_model_len)
    longest = max(len(p.token_ids) for p in prompts)
    if config.max_prompt_tokens is not None and longest > config.max_prompt_tokens:
        raise InvalidRequest(f"prompt has {longest} tokens; this server accepts at most "
                             f"{config.max_prompt_tokens}", param=plan.blame("prompt"))
    if longest >= context:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context} tokens. However, your prompt has "
            f"{longest} tokens, which leaves no room for the completion.", param=plan.blame("prompt"))
    requested = plan.max_tokens
    if requested is None:
        return min(config.default_max_tokens, context - longest)
    if longest + requested > context:
        param = plan.blame("max_tokens")
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{longest + requested} tokens ({longest} in the prompt, {requested} in the "
            f"completion). Please reduce the prompt or {param}.", param=param)
    return requested


def _check_ids(ids: list[int], info: EngineInfo, param: str) -> None:
    bad = [t for t in ids if t < 0 or t >= info.vocab_size]
    if bad:
        raise InvalidRequest(f"{param} contains token ids outside the vocabulary (size {info.vocab_size}): "
                             f"{bad[:5]}", param=param)


def sampling_params(request: GenerationFields, plan: Plan, max_tokens: int, info: EngineInfo) -> SamplingParams:
    logit_bias: tuple[tuple[int, float], ...] = ()
    if request.logit_bias:
        logit_bias = tuple((int(k), v) for k, v in request.logit_bias.items())
        _check_ids([k for k, _ in logit_bias], info, "logit_bias")
    stop_token_ids = tuple(request.stop_token_ids or ())
    _check_ids(list(stop_token_ids), info, "stop_token_ids")
    allowed = tuple(request.allowed_token_ids) if request.allowed_token_ids is not None else None
    if allowed is not None:
        _check_ids(list(allowed), info, "allowed_token_ids")
    if request.min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens must be less than or equal to max_tokens={max_tokens}",
                             param="min_tokens")
    logprobs = plan.logprobs
    if logprobs is None and plan.width > plan.n and not request.use_beam_search:
        logprobs = 0  # best_of ranks samples by their mean logprob
    seed = request.seed if request.seed is not None and request.seed != -1 else None
    top_k = request.top_k or 0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=0 if top_k < 0 else top_k,
        min_p=request.min_p or 0.0,
        seed=seed,
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        stop_token_ids=stop_token_ids,
        frequency_penalty=request.frequency_penalty or 0.0,
        presence_penalty=request.presence_penalty or 0.0,
        repetition_penalty=request.repetition_penalty or 1.0,
        logit_bias=logit_bias,
        allowed_token_ids=allowed,
        logprobs=logprobs,
        prompt_logprobs=plan.prompt_logprobs,
        use_beam_search=request.use_beam_search,
        length_penalty=request.length_penalty,
        early_stopping=request.early_stopping,
    )


def engine_priority(request: GenerationFields, tier_priority: Priority) -> Priority:
    """The service tier decides; within the normal tier, vLLM's ``priority`` (lower first) moves it."""
    if tier_priority != Priority.NORMAL:
        return tier_priority
    if request.priority < 0:
        return Priority.HIGH
    if request.priority > 0:
        return Priority.LOW
    return Priority.NORMAL
