"""0.12 hlapi LLM: keywords are ``LlmArgs``'s fields; ``generate_async(inputs, sampling_params=None,
streaming=False)`` returning a GenerationResult that supports await / async for; no abort, no
finish_reason, no *_diff properties."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import standin_core as core

from tensorrt_llm.hlapi.llm_utils import LlmArgs
from tensorrt_llm.hlapi.utils import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[float] = field(default_factory=list)
    generation_logits: Any = None


class GenerationResult(core.Result):
    pass


class LLM:
    def __init__(self, model: str, tokenizer: str | None = None, **kwargs: Any) -> None:
        self.args = LlmArgs.from_kwargs(model=model, tokenizer=tokenizer, **kwargs)
        self.config = core.read_engine_config(model)
        if "build_config" not in self.config:
            raise ValueError(f"{model} is not a TensorRT-LLM engine directory")
        self.model, self.tokenizer, self.kwargs = model, tokenizer, kwargs
        self.calls: list[dict[str, Any]] = []
        self.script: list[int] | None = None

    def generate_async(
        self, inputs: Any, sampling_params: SamplingParams | None = None, streaming: bool = False
    ) -> GenerationResult:
        core.require_loop()
        sp = sampling_params or SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise TypeError("sampling_params must be SamplingParams")
        prompt = list(inputs)
        core.check_embedding_bias(sp, self.config)
        if sp.return_generation_logits and not self.config["build_config"].get("gather_generation_logits"):
            raise ValueError("`return_generation_logits` needs an engine built with gather_generation_logits")
        self.calls.append({"inputs": prompt, "sampling_params": sp, "streaming": streaming})
        outs = [CompletionOutput(index=i) for i in range(sp.beam_width)]
        result = GenerationResult(prompt, outs, streaming=streaming)
        result.task = asyncio.get_running_loop().create_task(core.run(result, sp, self, finish_reasons=False))
        return result

    def shutdown(self) -> None:
        pass
