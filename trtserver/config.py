"""ServerConfig: one settings object, from CLI flags and an optional TOML file."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

if sys.version_info >= (3, 11):
    import tomllib
else:  # Jetson's Python 3.10
    import tomli as tomllib

class TierLimits(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    requests_per_minute: Annotated[int, Meta(ge=0)] | None = None
    tokens_per_minute: Annotated[int, Meta(ge=0)] | None = None


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Every setting. Field names are the CLI flags with ``_`` for ``-``."""

    engine_dir: str
    host: str = "127.0.0.1"
    port: int = 8000
    engine: str = "auto"
    served_model_name: str | None = None
    # PyTorch engine
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_batch_size: Annotated[int, Meta(ge=1)] = 16
    max_model_len: Annotated[int, Meta(ge=1)] | None = None
    prefill_chunk_size: Annotated[int, Meta(ge=16)] = 512
    threads: Annotated[int, Meta(ge=0)] = 0  # 0 = all cores but one on CPU (the event loop's)
    # CPU: threads for prefill and decode batches above 4 rows, whose GEMMs pay for a second core; 0 = every core
    batch_threads: Annotated[int, Meta(ge=0)] = 0
    # weight-only, PyTorch engine on CPU; auto = int4 when the weights came from a 4-bit GGUF (see docs/engines.md)
    quantization: Literal["auto", "none", "int8", "int4"] = "auto"
    # one set of kernels for every batch size: a request's tokens never depend on its neighbours
    batch_invariant: bool = False
    cuda_graphs: bool = True
    # the model in a process of its own, off the server's GIL (see trtserver/engine/torch/process.py)
    engine_process: bool = True
    # with engine_process on CPU: the engine's threads bound one per CPU (OpenMP), the event loop to the last CPU
    pin_threads: bool = True
    # TensorRT-LLM engine
    tensor_parallel_size: Annotated[int, Meta(ge=1)] = 1
    pipeline_parallel_size: Annotated[int, Meta(ge=1)] = 1
    trtllm_gather_generation_logits: bool = False
    trtllm_guided_decoding_backend: str | None = "xgrammar"
    max_lora_rank: Annotated[int, Meta(ge=1)] = 64
    # API limits (OpenAI's by default; each raisable)
    max_logprobs: Annotated[int, Meta(ge=0)] = 5
    max_stop_sequences: Annotated[int, Meta(ge=1)] = 4
    max_n: Annotated[int, Meta(ge=1)] = 128
    max_best_of: Annotated[int, Meta(ge=1)] = 20
    max_prompts: Annotated[int, Meta(ge=1)] = 256
    max_body_bytes: Annotated[int, Meta(ge=1024)] = 16 * 1024 * 1024
    max_prompt_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_waiting: Annotated[int, Meta(ge=1)] = 1024
    max_flex_waiting: Annotated[int, Meta(ge=0)] = 64
    request_timeout_s: Annotated[float, Meta(gt=0)] | None = None
    default_max_tokens: Annotated[int, Meta(ge=0)] = 16
    # plugins
    plugins: list[str] = []
    plugin_allowlist: list[str] | None = None
    guided_compile_timeout_s: Annotated[float, Meta(gt=0)] = 30.0
    # operations
    api_keys: list[str] = []
    no_limit_api_keys: list[str] = []
    quotas: dict[str, TierLimits] = {}
    # API key -> the ai_project_id values it may use (a TOML table); with any binding, other projects are a 403
    api_key_projects: dict[str, list[str]] = {}
    # projects the in-memory quota store tracks at once (idle ones are forgotten first)
    max_quota_projects: Annotated[int, Meta(ge=1)] = 10_000
    # /metrics needs one of these keys when any is set (a key for scrapers alone)
    metrics_api_keys: list[str] = []
    # /metrics needs an API key (any of api_keys, no_limit_api_keys, metrics_api_keys)
    metrics_need_api_key: bool = False
    # what OpenMetrics exemplars on the latency histogram carry: nothing, the request id, or it and `user`
    metrics_exemplars: Literal["none", "request_id", "request_id_and_user"] = "none"
    # JSON bodies nested deeper than this (objects and arrays) are refused with a 400
    max_json_depth: Annotated[int, Meta(ge=2)] = 64
    # seconds a client may take to send a request's headers (from its first byte), and its body: then a 408
    header_timeout_s: Annotated[float, Meta(gt=0)] = 10.0
    body_timeout_s: Annotated[float, Meta(gt=0)] = 60.0
    # seconds an idle keep-alive connection stays open
    keepalive_timeout_s: Annotated[float, Meta(gt=0)] = 75.0
    adapters_dir: str | None = None
    prompt_log_dir: str | None = None
    shutdown_grace_s: Annotated[float, Meta(ge=0)] = 30.0
    # auto = uvloop where it is installed (a dependency off Windows): ~15 % less event-loop CPU per token, measured
    event_loop: Literal["auto", "asyncio", "uvloop"] = "auto"
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: str = "info"

    @property
    def engine_path(self) -> Path:
        return Path(self.engine_dir)


def load_config_file(path: str | Path) -> dict[str, object]:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    section = data.get("server", data)
    if not isinstance(section, dict):
        raise ValueError(f"{path}: [server] must be a table")
    return section


def build_config(values: dict[str, object]) -> ServerConfig:
    """Validate a dict of settings (CLI merged over file) into a ServerConfig."""
    return msgspec.convert(values, ServerConfig, strict=False)
