"""0.16-era ``llmapi/llm.py``: one LLM class (TensorRT engine) whose keywords are ``LlmArgs``'s fields;
no abort (0.19), no prompt_logprobs, no per-request logits processors."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import standin_core as core

from tensorrt_llm.llmapi.llm_utils import LlmArgs
from tensorrt_llm.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generation_logits: Any = None
    _last_len: int = 0

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_len :]


class RequestOutput(core.Result):
    def __init__(self, *args: Any, llm: Any, gathered_logprobs: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._llm = llm
        self._gathered_logprobs = gathered_logprobs


class BaseLLM:
    trt = False

    def __init__(self, model: str, tokenizer: str | None = None, **kwargs: Any) -> None:
        self.args = LlmArgs.from_kwargs(model=model, tokenizer=tokenizer, **kwargs)
        backend = kwargs.get("guided_decoding_backend")
        if backend not in (None, "xgrammar"):
            raise ValueError(f"Unsupported guided decoding backend {backend}")
        self.config = core.read_engine_config(model)
        is_engine = "pretrained_config" in self.config and "build_config" in self.config
        if self.trt != is_engine:
            raise ValueError(f"{model}: model format does not match this LLM class")
        if is_engine and kwargs.get("tensor_parallel_size", 1) != 1:
            raise ValueError("tensor_parallel_size differs from the engine's mapping")
        self.model, self.tokenizer, self.kwargs = model, tokenizer, kwargs
        self.calls: list[dict[str, Any]] = []
        self.aborted: list[int] = []
        self.crashed = False
        self.shut = False
        self.script: list[int] | None = None

    def generate_async(
        self,
        inputs: Any,
        sampling_params: SamplingParams | None = None,
        lora_request: Any = None,
        prompt_adapter_request: Any = None,
        streaming: bool = False,
    ) -> RequestOutput:
        if self.shut or self.crashed:
            raise RuntimeError("LLM is shutting down")
        core.require_loop()
        sp = sampling_params or SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise TypeError("sampling_params must be SamplingParams")
        prompt = list(inputs["prompt_token_ids"] if isinstance(inputs, dict) else inputs)
        core.check_embedding_bias(sp, self.config)
        if sp.return_generation_logits and not self.config["build_config"].get("gather_generation_logits"):
            raise ValueError("`return_generation_logits` needs an engine built with gather_generation_logits")
        self._check_arguments(prompt, sp)
        self.calls.append(
            {"inputs": prompt, "sampling_params": sp, "lora_request": lora_request, "streaming": streaming}
        )
        count = sp.best_of or sp.n
        outs = [CompletionOutput(index=i) for i in range(count)]
        result = RequestOutput(
            prompt, outs, streaming=streaming, llm=self, gathered_logprobs=False
        )
        result.task = asyncio.get_running_loop().create_task(core.run(result, sp, self, finish_reasons=True))
        return result

    def _check_arguments(self, prompt: list[int], sp: SamplingParams) -> None:
        build = self.config.get("build_config", {})
        if self.trt:
            if prompt and len(prompt) + sp.max_tokens > build.get("max_seq_len", 1 << 30):
                raise ValueError("prompt length plus max_tokens exceeds max_seq_len")
            if sp.return_context_logits and not build.get("gather_context_logits"):
                raise ValueError("`return_context_logits` needs an engine built with gather_context_logits")
            if sp.use_beam_search and (sp.best_of or 1) > build.get("max_beam_width", 1):
                raise ValueError("best_of exceeds max_beam_width")
        if sp.guided_decoding is not None and self.kwargs.get("guided_decoding_backend") is None:
            raise RuntimeError(
                "Request is specified with GuidedDecodingParams, but GuidedDecoder is not setup"
            )

    def shutdown(self) -> None:
        self.shut = True


class LLM(BaseLLM):
    trt = True
