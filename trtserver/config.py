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
    trtllm_max_beam_width: Annotated[int, Meta(ge=1)] = 1  # the PyTorch backend's beam search needs it at load
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
    # chat: a template FILE or the template text itself, over the engine directory's (see docs/api.md)
    chat_template: str | None = None
    # chat: the registered parser that finds tool calls in generated text (tool_choice auto), e.g. hermes
    tool_call_parser: str | None = None
    # plugins: extra modules or .py files to load (the TOML `[plugins]` table's `load` list)
    plugins: list[str] = []
    # each plugin's `[plugins.<name>]` table, read by the plugin through `plugin_config(name)`
    plugin_settings: dict[str, dict[str, Any]] = {}
    plugin_allowlist: list[str] | None = None
    guided_compile_timeout_s: Annotated[float, Meta(gt=0)] = 30.0
    # operations
    api_keys: list[str] = []
    no_limit_api_keys: list[str] = []
    quotas: dict[str, TierLimits] = {}
    adapters_dir: str | None = None
    prompt_log_dir: str | None = None
    shutdown_grace_s: Annotated[float, Meta(ge=0)] = 30.0
    # auto = uvloop where it is installed (a dependency off Windows): less event-loop CPU per token
    event_loop: Literal["auto", "asyncio", "uvloop"] = "auto"
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: str = "info"

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
