"""vLLM's ``/tokenize`` and ``/detokenize``: the served model's tokenizer, and the chat template for messages."""

from __future__ import annotations

from trtserver.errors import InvalidRequest, NotFound
from trtserver.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from trtserver.serving.chat import render_messages
from trtserver.serving.core import Service


def _check_model(model: str | None, service: Service) -> None:
    if model is not None and model != service.model_name:
        raise NotFound(f"The model `{model}` does not exist.", param="model")


def tokenize(service: Service, request: TokenizeRequest) -> TokenizeResponse:
    _check_model(request.model, service)
    if request.messages is not None:
        ids = render_messages(service, request.messages, tools=request.tools, template_text=request.chat_template,
                              add_generation_prompt=request.add_generation_prompt,
                              continue_final_message=request.continue_final_message,
                              kwargs=request.chat_template_kwargs,
                              add_special_tokens=bool(request.add_special_tokens)).token_ids
    else:
        add = True if request.add_special_tokens is None else request.add_special_tokens
        ids = service.tokenizer.encode(request.prompt or "", add_special_tokens=add)
    strs = [service.tokenizer.id_to_token(t) or "" for t in ids] if request.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=service.context_length, tokens=ids, token_strs=strs)


def detokenize(service: Service, request: DetokenizeRequest) -> DetokenizeResponse:
    _check_model(request.model, service)
    bad = [t for t in request.tokens if t >= service.info.vocab_size]
    if bad:
        raise InvalidRequest(f"tokens {bad[:5]} are outside the vocabulary (size {service.info.vocab_size})",
                             param="tokens")
    return DetokenizeResponse(prompt=service.tokenizer.decode(list(request.tokens), skip_special_tokens=False))
