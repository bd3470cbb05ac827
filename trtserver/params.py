"""A validated request, turned into engine requests: everything that needs the model to check.

Checks that need no model live in ``protocol.py``; here are the ones that need the tokenizer,
the context length, the vocabulary and the engine's capabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

from trtserver.config import ServerConfig
from trtserver.engine.base import EngineInfo, Priority, SamplingParams
from trtserver.errors import ContextLengthExceeded, InvalidRequest, NotFound, Unsupported
from trtserver.protocol import CompletionRequest
from trtserver.tokenizer import Tokenizer

# request fields that parse and validate but that this build does not implement yet
NOT_IMPLEMENTED: dict[str, str] = {
    "logits_processors": "logits processors by name are not supported; install a plugin that "
    "implements trtserver_logits_processors instead",
}


@dataclass(slots=True)
class PromptInput:
    token_ids: list[int]
    text: str | None  # the prompt as text when the client sent text (None for token ids)


def check_model(request: CompletionRequest, served_name: str) -> None:
    if request.model is not None and request.model != served_name:
        raise NotFound(f"The model `{request.model}` does not exist.", param="model")


def check_limits(request: CompletionRequest, config: ServerConfig, info: EngineInfo) -> None:
    for name, message in NOT_IMPLEMENTED.items():
        if getattr(request, name) not in (None, False, [], 0):
            raise Unsupported(message, param=name)
    caps = info.capabilities
    max_logprobs = min(config.max_logprobs, caps.max_logprobs) if caps.max_logprobs else config.max_logprobs
    if request.logprobs is not None and request.logprobs > max_logprobs:
        raise InvalidRequest(f"logprobs must be at most {max_logprobs}, got {request.logprobs}", param="logprobs")
    if request.prompt_logprobs is not None and request.prompt_logprobs > max_logprobs:
        raise InvalidRequest(f"prompt_logprobs must be at most {max_logprobs}, got {request.prompt_logprobs}",
                             param="prompt_logprobs")
    if request.n > config.max_n:
        raise InvalidRequest(f"n must be at most {config.max_n}, got {request.n}", param="n")
    if request.best_of is not None and request.best_of > config.max_best_of:
        raise InvalidRequest(f"best_of must be at most {config.max_best_of}, got {request.best_of}",
                             param="best_of")
    stops = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
    if len(stops) > config.max_stop_sequences:
        raise InvalidRequest(f"stop may hold at most {config.max_stop_sequences} sequences, got {len(stops)}",
                             param="stop")
    if len(request.prompts) > config.max_prompts:
        raise InvalidRequest(f"at most {config.max_prompts} prompts per request, got {len(request.prompts)}",
                             param="prompt")
    width = request.best_of or request.n
    if width > 1 and not caps.multiple_sequences:
        raise Unsupported(f"this engine ({info.backend}) cannot generate several sequences per prompt",
                          param="best_of" if request.best_of else "n")
    if request.use_beam_search and not caps.beam_search:
        raise Unsupported(f"this engine ({info.backend}) does not support beam search", param="use_beam_search")
    wants_prompt_logprobs = request.prompt_logprobs is not None or request.loglikelihood or (
        request.echo and request.logprobs is not None)
    if wants_prompt_logprobs and not caps.prompt_logprobs:
        raise Unsupported(f"this engine ({info.backend}) cannot return prompt logprobs (a TensorRT-LLM engine "
                          "needs gather_context_logits at build time)",
                          param="prompt_logprobs" if request.prompt_logprobs is not None else "echo")
    if request.peft is not None and not caps.adapters:
        raise Unsupported(f"LoRA adapters are not enabled on this server ({info.backend} engine); start it with "
                          "--adapters-dir", param="peft")
    if request.priority != 0 and not caps.priority:
        raise Unsupported(f"this engine ({info.backend}) does not support priority", param="priority")


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


def resolve_max_tokens(request: CompletionRequest, prompts: list[PromptInput], config: ServerConfig,
                       info: EngineInfo) -> int:
    context = info.context_length
    if config.max_model_len is not None:
        context = min(context, config.max_model_len)
    longest = max(len(p.token_ids) for p in prompts)
    if config.max_prompt_tokens is not None and longest > config.max_prompt_tokens:
        raise InvalidRequest(f"prompt has {longest} tokens; this server accepts at most "
                             f"{config.max_prompt_tokens}", param="prompt")
    if longest >= context:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context} tokens. However, your prompt has "
            f"{longest} tokens, which leaves no room for the completion.", param="prompt")
    if request.max_tokens is None:
        return min(config.default_max_tokens, context - longest)
    if longest + request.max_tokens > context:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{longest + request.max_tokens} tokens ({longest} in the prompt, {request.max_tokens} in the "
            "completion). Please reduce the prompt or max_tokens.", param="max_tokens")
    return request.max_tokens


def _check_ids(ids: list[int], info: EngineInfo, param: str) -> None:
    bad = [t for t in ids if t < 0 or t >= info.vocab_size]
    if bad:
        raise InvalidRequest(f"{param} contains token ids outside the vocabulary (size {info.vocab_size}): "
                             f"{bad[:5]}", param=param)


def sampling_params(request: CompletionRequest, max_tokens: int, info: EngineInfo, *,
                    rank_by_logprob: bool) -> SamplingParams:
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
    wants_prompt = request.loglikelihood or (request.echo and request.logprobs is not None)
    prompt_logprobs = request.prompt_logprobs
    if wants_prompt:
        prompt_logprobs = max(prompt_logprobs or 0, request.logprobs or 0)
    logprobs = request.logprobs
    if logprobs is None and rank_by_logprob:
        logprobs = 0
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
        prompt_logprobs=prompt_logprobs,
        use_beam_search=request.use_beam_search,
        length_penalty=request.length_penalty,
        early_stopping=request.early_stopping,
    )


def engine_priority(request: CompletionRequest, tier_priority: Priority) -> Priority:
    """The service tier decides; within the normal tier, vLLM's ``priority`` (lower first) moves it."""
    if tier_priority != Priority.NORMAL:
        return tier_priority
    if request.priority < 0:
        return Priority.HIGH
    if request.priority > 0:
        return Priority.LOW
    return Priority.NORMAL
