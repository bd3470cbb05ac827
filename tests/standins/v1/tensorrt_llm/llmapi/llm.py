"""BaseLLM / _TrtLLM / _TorchLLM / LLM(_TorchLLM) as in ≈1.1 ``llmapi/llm.py`` (ref §1)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import standin_core as core

from tensorrt_llm.executor import RequestError
from tensorrt_llm.sampling_params import SamplingParams

COMMON = {
    "tokenizer",
    "tokenizer_mode",
    "skip_tokenizer_init",
    "trust_remote_code",
    "tensor_parallel_size",
    "dtype",
    "revision",
    "tokenizer_revision",
    "pipeline_parallel_size",
    "gather_generation_logits",
    "guided_decoding_backend",
    "lora_config",
    "kv_cache_config",
    "max_batch_size",
    "max_num_tokens",
    "max_seq_len",
    "max_beam_width",
    "build_config",
    "enable_chunked_prefill",
    "peft_cache_config",
    "backend",
}
TRT_ONLY = {
    "enable_tqdm",
    "workspace",
    "enable_build_cache",
    "calib_config",
    "quant_config",
    "fast_build",
    "batching_type",
    "normalize_log_probs",
    "extended_runtime_perf_knob_config",
    "embedding_parallel_mode",
    "enable_prompt_adapter",
    "max_prompt_adapter_token",
    "enable_lora",
}


# 1.0 docs/source/1.0/features/sampling.md: beam search needs the TRT-LLM sampler and no overlap/CUDA graphs
TORCH_ONLY = {"enable_trtllm_sampler", "disable_overlap_scheduler", "cuda_graph_config"}


class TorchLlmArgs:
    """``llm_args.TorchLlmArgs`` (a pydantic model with extra="forbid"): its ``model_fields``."""

    model_fields: dict[str, Any] = dict.fromkeys(COMMON | TORCH_ONLY)


class TrtLlmArgs:
    model_fields: dict[str, Any] = dict.fromkeys(COMMON | TRT_ONLY)


class KvCacheConfig:
    """``llm_args.KvCacheConfig(StrictBaseModel)``: ``enable_block_reuse`` defaults to True; an unknown
    name fails validation (pydantic's ValidationError is a ValueError)."""

    model_fields: dict[str, Any] = dict.fromkeys((
        "enable_block_reuse", "max_tokens", "max_attention_window", "sink_token_length",
        "free_gpu_memory_fraction", "host_cache_size", "onboard_blocks", "cross_kv_cache_fraction",
        "secondary_offload_min_priority", "event_buffer_max_size", "enable_partial_reuse",
        "copy_on_partial_reuse", "dtype"))

    def __init__(self, **kwargs: Any) -> None:
        for key in kwargs:
            if key not in self.model_fields:
                raise ValueError(f"1 validation error for KvCacheConfig\n{key}\n  Extra inputs are not permitted")
        self.enable_block_reuse = bool(kwargs.get("enable_block_reuse", True))


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[Any] = field(default_factory=list)
    prompt_logprobs: list[Any] = field(default_factory=list)
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
        if core.release(llm) >= (1, 1):
            self.cached_tokens = 0  # GenerationResultBase.__init__ (1.1+)

    def _on_response(self) -> None:
        """``self.cached_tokens = getattr(response_result, 'cached_tokens', 0)`` (1.1+): the PyTorch
        backend's LlmResult carries the reused count; the C++ Result of the TensorRT backend has no
        such field, so there it is 0."""
        if hasattr(self, "cached_tokens"):
            self.cached_tokens = 0 if self._llm.trt else self.reused_tokens

    def abort(self) -> None:
        if self._streaming and self._gathered_logprobs and not self._done:
            self._llm.crashed = True  # NVIDIA/TensorRT-LLM#10810
            raise RuntimeError("executor crashed: abort of a streaming request with logprobs (#10810)")
        self._cancel = True
        self._llm.aborted.append(self.request_id)

    def aborted(self) -> bool:
        return self._cancel


class BaseLLM:
    trt = False
    load_seconds = 0.0  # how long building the executor takes (a blocking wait, as a real load is)

    def __init__(self, model: str, tokenizer: str | None = None, **kwargs: Any) -> None:
        core.check_kwargs(kwargs, COMMON | (TRT_ONLY if self.trt else TORCH_ONLY))
        bad = set(kwargs) & TRT_ONLY
        if bad and not self.trt:
            raise ValueError(
                f"{sorted(bad)} are specific to TensorRT backend; use "
                "'from tensorrt_llm._tensorrt_engine import LLM'"
            )
        backend = kwargs.get("guided_decoding_backend")
        if backend not in (None, "xgrammar", "llguidance") or (
            self.trt and backend not in (None, "xgrammar")
        ):
            raise ValueError(f"Unsupported guided decoding backend {backend}")
        time.sleep(self.load_seconds)
        self.config = core.read_engine_config(model)
        is_engine = "pretrained_config" in self.config and "build_config" in self.config
        if self.trt != is_engine:
            raise ValueError(f"{model}: model format does not match this LLM class")
        if is_engine and kwargs.get("tensor_parallel_size", 1) != 1:
            raise ValueError("tensor_parallel_size differs from the engine's mapping")
        self.model, self.tokenizer, self.kwargs = model, tokenizer, kwargs
        self.lora_module_layers = self._lora_module_layers() if is_engine else None
        self.calls: list[dict[str, Any]] = []
        self.aborted: list[int] = []
        self.crashed = False
        self.shut = False
        self.script: list[int] | None = None
        self.max_queue_size: int | None = None
        kv = kwargs.get("kv_cache_config")
        self.kv_blocks = core.PrefixBlocks() if (kv is None or kv.enable_block_reuse) else None

    def generate_async(
        self,
        inputs: Any,
        sampling_params: SamplingParams | None = None,
        lora_request: Any = None,
        prompt_adapter_request: Any = None,
        streaming: bool = False,
        kv_cache_retention_config: Any = None,
        disaggregated_params: Any = None,
        _postproc_params: Any = None,
        scheduling_params: Any = None,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        if self.shut or self.crashed:
            raise RuntimeError("LLM is shutting down")
        core.require_loop()
        sp = sampling_params or SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise TypeError("sampling_params must be SamplingParams")
        prompt = list(inputs["prompt_token_ids"] if isinstance(inputs, dict) else inputs)
        core.check_embedding_bias(sp, self.config)
        self._check_arguments(prompt, sp)
        if self.max_queue_size is not None and len(self.calls) >= self.max_queue_size:
            # executorImpl.cpp enqueueRequests, surfacing as the worker's RequestError
            raise RequestError(
                f"Maximum queue size of {self.max_queue_size} has been reached, please try again later"
            )
        if len(prompt) > self.config.get("build_config", {}).get("max_input_len", 1 << 30):
            raise RequestError(f"Prompt length ({len(prompt)}) exceeds maximum input length")
        if lora_request is not None and self.lora_module_layers == 0:
            # a PEFT cache sized for no module can hold no adapter (the likely outcome in C++)
            raise RequestError("LoRA adapter does not fit the PEFT cache (0 module layers)")
        self.calls.append(
            {"inputs": prompt, "sampling_params": sp, "lora_request": lora_request, "streaming": streaming}
        )
        count = sp.best_of or sp.n
        outs = [CompletionOutput(index=i) for i in range(count)]
        result = RequestOutput(
            prompt, outs, streaming=streaming, llm=self, gathered_logprobs=bool(self.trt and sp.logprobs)
        )
        result.task = asyncio.get_running_loop().create_task(core.run(result, sp, self, finish_reasons=True))
        return result

    def _lora_module_layers(self) -> int | None:
        """≈1.1 ``_TrtLLM._build_model``: the engine's lora_config unless the LLM args carry one
        ("Overriding lora_config from engine with lora_config from LLM args"); the PEFT cache holds
        ``num_hidden_layers * len(lora_target_modules + missing_qkv_modules)`` module layers."""
        build = self.config["build_config"]
        if build.get("plugin_config", {}).get("lora_plugin") in (None, False, "disable"):
            return None
        lora = self.kwargs.get("lora_config")
        modules = list(lora.lora_target_modules) if lora is not None else list(
            build.get("lora_config", {}).get("lora_target_modules", []))
        return int(self.config["pretrained_config"].get("num_hidden_layers", 1)) * len(modules)

    def _check_arguments(self, prompt: list[int], sp: SamplingParams) -> None:
        build = self.config.get("build_config", {})
        if self.trt:
            if prompt and len(prompt) + sp.max_tokens > build.get("max_seq_len", 1 << 30):
                raise ValueError("prompt length plus max_tokens exceeds max_seq_len")
            if sp.prompt_logprobs and not build.get("gather_context_logits"):
                raise ValueError(
                    "`prompt_logprobs` requires `gather_context_logits=True` in the `BuildConfig`"
                )
            if sp.return_context_logits and not build.get("gather_context_logits"):
                raise ValueError(
                    "`return_context_logits` requires `gather_context_logits=True` in the `BuildConfig`"
                )
            if sp.logprobs and not self.kwargs.get("gather_generation_logits"):
                raise ValueError(
                    "`logprobs` requires `gather_generation_logits=True` to be passed explicitly "
                    "to the `LLM()` constructor"
                )
            if sp.use_beam_search and (sp.best_of or 1) > build.get("max_beam_width", 1):
                raise ValueError("best_of exceeds max_beam_width")
        if not self.trt and sp.use_beam_search:
            if (sp.best_of or 1) > self.kwargs.get("max_beam_width", 1):
                raise ValueError("best_of exceeds the LLM's max_beam_width")
            if core.release(self) < (1, 2) and not self.kwargs.get("enable_trtllm_sampler"):
                raise ValueError("beam search on the PyTorch backend needs enable_trtllm_sampler=True")
        if sp.guided_decoding is not None and self.kwargs.get("guided_decoding_backend") is None:
            raise RuntimeError(
                "Request is specified with GuidedDecodingParams, but GuidedDecoder is not setup"
            )

    def shutdown(self) -> None:
        self.shut = True


class _TrtLLM(BaseLLM):
    trt = True


class _TorchLLM(BaseLLM):
    trt = False


class LLM(_TorchLLM):
    pass
