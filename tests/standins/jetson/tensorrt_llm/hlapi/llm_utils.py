"""0.12 ``hlapi/llm_utils.py`` ``LlmArgs``: a ``@dataclass`` built with ``cls(**kwargs)`` (an unknown keyword is a
``TypeError``); no ``gather_generation_logits``, no LoRA in the LLM class, no guided decoding backend."""

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
    auto_parallel: bool = False
    auto_parallel_world_size: int = 1
    load_format: str = "auto"
    quant_config: Any = None
    calib_config: Any = None
    build_config: Any = None
    kv_cache_config: Any = None
    enable_chunked_prefill: bool = False
    decoding_config: Any = None
    logits_post_processor_map: Any = None
    iter_stats_max_iterations: int | None = None
    request_stats_max_iterations: int | None = None
    workspace: str | None = None
    embedding_parallel_mode: str = "SHARDING_ALONG_VOCAB"
    share_embedding_table: bool = False
    fast_build: bool = False
    enable_build_cache: Any = False
    peft_cache_config: Any = None
    scheduler_config: Any = None
    batching_type: Any = None
    normalize_log_probs: bool = False

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LlmArgs:
        return cls(**kwargs)
