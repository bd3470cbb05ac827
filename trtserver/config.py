"""ServerConfig: one settings object, from CLI flags and an optional TOML file."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Literal

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
    """Every setting. Field names are the CLI flags with ``_`` for ``-``; each carries its one-line description."""

    engine_dir: Annotated[str, Meta(description="engine directory to serve (made by `trtserver build`)")]
    host: Annotated[str, Meta(description="address to listen on")] = "127.0.0.1"
    port: Annotated[int, Meta(description="TCP port to listen on")] = 8000
    engine: Annotated[str, Meta(
        description="engine to run: auto (TensorRT-LLM when it imports, a GPU is present and the directory "
                    "holds its engine; else torch), torch, trtllm, or one a plugin registers")] = "auto"
    served_model_name: Annotated[str | None, Meta(
        description="model name clients send and /v1/models lists; default: the manifest's")] = None
    # PyTorch engine
    device: Annotated[str, Meta(description="PyTorch engine: auto, cpu, cuda or cuda:N")] = "auto"
    dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16"], Meta(
        description="PyTorch engine weights' dtype; auto = bfloat16 on CUDA and on CPUs with native bf16 dot "
                    "products, else whichever decodes faster")] = "auto"
    max_batch_size: Annotated[int, Meta(ge=1, description="sequences decoded together (KV-cache slots)")] = 16
    max_model_len: Annotated[Annotated[int, Meta(ge=1)] | None, Meta(
        description="context length in tokens, prompt and completion; default: the manifest's")] = None
    prefix_cache: Annotated[bool, Meta(
        description="reuse the K/V of prompt prefixes the engine has already computed (a chat's system prompt "
                    "and earlier turns); TensorRT-LLM: its KV-cache block reuse")] = True
    prefix_cache_slots: Annotated[Annotated[int, Meta(ge=0)] | None, Meta(
        description="PyTorch engine: KV-cache slots beyond --max-batch-size that only keep cached prefixes "
                    "(each holds one sequence's K/V); default: a quarter of --max-batch-size")] = None
    prefill_chunk_size: Annotated[int, Meta(
        ge=16, description="prompt tokens prefilled per step, interleaved with decode steps")] = 512
    threads: Annotated[int, Meta(
        ge=0, description="CPU: engine threads; 0 = every core (every core but one with "
                          "--no-engine-process, leaving one to the event loop)")] = 0
    batch_threads: Annotated[int, Meta(
        ge=0, description="CPU: threads for prefill and decode batches above the small-batch limit (4 rows; "
                          "with the engine's own int4 kernel every decode batch is small); 0 = --threads, or "
                          "every core")] = 0
    quantization: Annotated[Literal["auto", "none", "int8", "int4"], Meta(
        description="CPU weight-only quantization of small decode batches; auto = int4 when the weights came "
                    "from a 4-bit GGUF and --dtype is auto or bfloat16, else none")] = "auto"
    batch_invariant: Annotated[bool, Meta(
        description="one set of kernels for every batch size, so a seeded request's tokens never depend on "
                    "its neighbours (slower at small batches)")] = False
    cuda_graphs: Annotated[bool, Meta(description="CUDA: replay decode steps from CUDA graphs")] = True
    engine_process: Annotated[bool, Meta(
        description="run the PyTorch engine's model in a process of its own, off the server's GIL")] = True
    pin_threads: Annotated[bool, Meta(
        description="CPU, with --engine-process: bind the engine's threads one per CPU and the event loop to "
                    "the last CPU")] = True
    # TensorRT-LLM engine
    tensor_parallel_size: Annotated[int, Meta(ge=1, description="TensorRT-LLM: tensor-parallel GPUs")] = 1
    pipeline_parallel_size: Annotated[int, Meta(ge=1, description="TensorRT-LLM: pipeline-parallel GPUs")] = 1
    trtllm_gather_generation_logits: Annotated[bool, Meta(
        description="TensorRT-LLM: return generation logits, so logprobs come from them (where the version "
                    "supports it)")] = False
    trtllm_guided_decoding_backend: Annotated[str | None, Meta(
        description="TensorRT-LLM: its guided-decoding backend (xgrammar where installed); empty leaves "
                    "guided decoding to the plugins")] = "xgrammar"
    trtllm_max_beam_width: Annotated[int, Meta(
        ge=1, description="TensorRT-LLM PyTorch backend: the largest beam width beam search may use, set at "
                          "load")] = 1
    max_lora_rank: Annotated[int, Meta(ge=1, description="largest LoRA adapter rank accepted")] = 64
    # API limits (OpenAI's by default; each raisable)
    max_logprobs: Annotated[int, Meta(ge=0, description="largest `logprobs` / `top_logprobs` a request may ask")] = 5
    max_stop_sequences: Annotated[int, Meta(ge=1, description="most `stop` strings per request")] = 4
    max_n: Annotated[int, Meta(ge=1, description="largest `n`")] = 128
    max_best_of: Annotated[int, Meta(ge=1, description="largest `best_of`")] = 20
    max_prompts: Annotated[int, Meta(ge=1, description="most prompts in one completions request")] = 256
    max_body_bytes: Annotated[int, Meta(ge=1024, description="largest request body; larger is a 413")] = (
        16 * 1024 * 1024)
    max_prompt_tokens: Annotated[Annotated[int, Meta(ge=1)] | None, Meta(
        description="longest prompt in tokens; default: only the context length limits it")] = None
    max_waiting: Annotated[int, Meta(
        ge=1, description="requests queued beyond the running batch; more get a 503 with Retry-After")] = 1024
    max_flex_waiting: Annotated[int, Meta(
        ge=0, description="`service_tier: flex` requests in flight at once; more get a 429")] = 64
    request_timeout_s: Annotated[Annotated[float, Meta(gt=0)] | None, Meta(
        description="seconds a request may run before it is aborted; default: no limit")] = None
    default_max_tokens: Annotated[int, Meta(
        ge=0, description="`max_tokens` of a completions request that gives none")] = 16
    chat_template: Annotated[str | None, Meta(
        description="chat: a template file, or the template text itself, used instead of the engine "
                    "directory's")] = None
    tool_call_parser: Annotated[str | None, Meta(
        description="chat: the registered parser that finds tool calls in generated text (tool_choice auto), "
                    "e.g. hermes")] = None
    # plugins
    plugins: Annotated[list[str], Meta(
        description="extra plugin modules or .py files to load (the TOML `[plugins]` table's `load` list)")] = []
    plugin_settings: Annotated[dict[str, dict[str, Any]], Meta(
        description="each plugin's `[plugins.<name>]` table (TOML only), read through `plugin_config(name)`")] = {}
    plugin_allowlist: Annotated[list[str] | None, Meta(
        description="load only these installed plugins (entry-point names); default: all, or "
                    "TRTSERVER_LOAD_PLUGINS")] = None
    guided_compile_timeout_s: Annotated[float, Meta(
        gt=0, description="seconds a guided-decoding grammar may take to compile before the request fails")] = 30.0
    # operations
    api_keys: Annotated[list[str], Meta(
        description="bearer keys accepted in Authorization; empty = no authentication")] = []
    no_limit_api_keys: Annotated[list[str], Meta(description="keys accepted and exempt from quotas")] = []
    quotas: Annotated[dict[str, TierLimits], Meta(
        description="per-tier requests and tokens per minute (a TOML table, no flag)")] = {}
    api_key_projects: Annotated[dict[str, list[str]], Meta(
        description="API key -> the ai_project_id values it may use (a TOML table); with any binding, other "
                    "projects are a 403")] = {}
    max_quota_projects: Annotated[int, Meta(
        ge=1, description="projects the in-memory quota store tracks at once (idle ones are forgotten first)")] = 10_000
    metrics_api_keys: Annotated[list[str], Meta(
        description="/metrics needs one of these keys when any is set (a key for scrapers alone)")] = []
    metrics_need_api_key: Annotated[bool, Meta(
        description="/metrics needs an API key (any of api_keys, no_limit_api_keys, metrics_api_keys)")] = False
    metrics_exemplars: Annotated[Literal["none", "request_id", "request_id_and_user"], Meta(
        description="what OpenMetrics exemplars on the latency histogram carry: nothing, the request id, or it "
                    "and `user`")] = "none"
    metrics_port: Annotated[Annotated[int, Meta(ge=1, le=65535)] | None, Meta(
        description="serve /metrics on a listener of its own at this port (the main port's /metrics then "
                    "answers 404); default: on the main port")] = None
    metrics_host: Annotated[str | None, Meta(
        description="address the --metrics-port listener binds, e.g. an internal interface; default: --host")] = None
    max_json_depth: Annotated[int, Meta(
        ge=2, description="JSON bodies nested deeper than this (objects and arrays) are refused with a 400")] = 64
    header_timeout_s: Annotated[float, Meta(
        gt=0, description="seconds a client may take to send a request's headers; then a 408")] = 10.0
    body_timeout_s: Annotated[float, Meta(
        gt=0, description="seconds a client may take to send a request's body; then a 408")] = 60.0
    keepalive_timeout_s: Annotated[float, Meta(
        gt=0, description="seconds an idle keep-alive connection stays open")] = 75.0
    adapters_dir: Annotated[str | None, Meta(
        description="directory of LoRA adapters, each served as a model name")] = None
    shutdown_grace_s: Annotated[float, Meta(
        ge=0, description="seconds running requests may finish after SIGTERM")] = 30.0
    event_loop: Annotated[Literal["auto", "asyncio", "uvloop"], Meta(
        description="event loop; auto = uvloop where it is installed")] = "auto"
    log_format: Annotated[Literal["auto", "json", "console"], Meta(
        description="log lines as JSON or for a console; auto = console on a terminal, else JSON")] = "auto"
    log_level: Annotated[str, Meta(description="least severe level logged: debug, info, warning, error")] = "info"

    def __post_init__(self) -> None:
        if self.metrics_host is not None and self.metrics_port is None:
            raise ValueError("metrics_host is the address of the --metrics-port listener: set metrics_port too")
        if self.metrics_port == self.port and (self.metrics_host or self.host) == self.host:
            raise ValueError(f"metrics_port {self.metrics_port} is the main port; give /metrics another port")

    @property
    def prefix_cache_extra_slots(self) -> int:
        """KV-cache slots kept for cached prefixes only, beyond the ``max_batch_size`` running ones."""
        if not self.prefix_cache:
            return 0
        return self.prefix_cache_slots if self.prefix_cache_slots is not None else max(1, self.max_batch_size // 4)

    @property
    def engine_path(self) -> Path:
        return Path(self.engine_dir)

    def plugin_config(self, name: str) -> dict[str, Any]:
        """The ``[plugins.<name>]`` table of the config file (a copy; empty when there is none)."""
        return dict(self.plugin_settings.get(name, {}))


def load_config_file(path: str | Path) -> dict[str, object]:
    """The file's ``[server]`` table (or the whole file without one), with a top-level ``[plugins]``
    table beside ``[server]`` taken in, and ``plugins`` split into the load list and the settings."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    section = data.get("server", data)
    if not isinstance(section, dict):
        raise ValueError(f"{path}: [server] must be a table")
    if section is not data and "plugins" in data:
        if "plugins" in section:
            raise ValueError(f"{path}: plugins are set both in [server] and in [plugins]; keep one")
        section = {**section, "plugins": data["plugins"]}
    try:
        return split_plugins_table(section)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def split_plugins_table(values: dict[str, object]) -> dict[str, object]:
    """``plugins`` may be a list of modules to load, or a table: ``load`` (that list) and one
    sub-table of settings per plugin. Returns the settings with ``plugins`` a list and the
    sub-tables under ``plugin_settings``."""
    table = values.get("plugins")
    if not isinstance(table, dict):
        return values
    settings = {}
    for name, value in table.items():
        if name == "load":
            continue
        if not isinstance(value, dict):
            raise ValueError(f"[plugins] holds `load` (a list of modules) and one [plugins.<name>] table per plugin; "
                             f"`{name}` is neither")
        settings[name] = value
    merged = {**values, "plugins": table.get("load", [])}
    if settings:
        if "plugin_settings" in values:
            raise ValueError("plugin settings are given both as [plugins.<name>] tables and as plugin_settings")
        merged["plugin_settings"] = settings
    return merged


def build_config(values: dict[str, object]) -> ServerConfig:
    """Validate a dict of settings (CLI merged over file) into a ServerConfig."""
    return msgspec.convert(split_plugins_table(values), ServerConfig, strict=False)
