"""0.16-era ``llmapi/llm_utils.py`` ``LlmArgs``: a plain ``@dataclass`` built with ``cls(**kwargs)``, so an
unknown keyword is a ``TypeError`` at ``LLM()``. LoRA is four flat fields (no ``lora_config``), and there
is no ``gather_generation_logits`` (SamplingParams has no ``logprobs: int`` to use it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from standin_core import KvCacheConfigBinding as KvCacheConfig  # the C++ binding, re-exported

__all__ = ["KvCacheConfig", "LlmArgs"]


@dataclass
class LlmArgs:
    model: str | Path
    tokenizer: Any = None
    tokenizer_mode: str = "auto"
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    revision: str | None = None
    tokenizer_revision: str | None = None
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    gpus_per_node: int | None = None
    moe_tensor_parallel_size: int | None = None
    moe_expert_parallel_size: int | None = None
    auto_parallel: bool = False
    auto_parallel_world_size: int = 1
    load_format: str = "auto"
    enable_tqdm: bool = False
    enable_lora: bool = False
    max_lora_rank: int | None = None
    max_loras: int = 4
    max_cpu_loras: int = 4
    enable_prompt_adapter: bool = False
    max_prompt_adapter_token: int = 0
    quant_config: Any = None
    calib_config: Any = None
    build_config: Any = None
    kv_cache_config: Any = None
    enable_chunked_prefill: bool = False
    guided_decoding_backend: str | None = None
    iter_stats_max_iterations: int | None = None
    request_stats_max_iterations: int | None = None
    workspace: str | None = None
    embedding_parallel_mode: str = "SHARDING_ALONG_VOCAB"
    fast_build: bool = False
    enable_build_cache: Any = False
    peft_cache_config: Any = None
    scheduler_config: Any = None
    speculative_config: Any = None
    decoding_config: Any = None
    batching_type: Any = None
    normalize_log_probs: bool = False
    extended_runtime_perf_knob_config: Any = None
    max_input_len: int = 1024
    max_seq_len: int | None = None
    max_beam_width: int = 1
    max_batch_size: int | None = None
    max_num_tokens: int | None = None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LlmArgs:
        return cls(**kwargs)
