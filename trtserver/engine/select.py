"""Which engine serves: ``--engine NAME`` or ``auto`` (TensorRT-LLM when it can run, else PyTorch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from trtserver.errors import APIError

if TYPE_CHECKING:
    import pluggy

    from trtserver.config import ServerConfig
    from trtserver.engine.base import Engine

log = structlog.get_logger("trtserver.engine")


class EngineSelectionError(APIError):
    pass


def registered_engines(pm: pluggy.PluginManager) -> dict[str, Callable[[ServerConfig], Engine]]:
    """Every engine plugins register, by name; a name registered twice raises ``PluginLoadError``."""
    from trtserver.plugins import registrations

    return {name: registration.factory for name, registration in registrations(pm, "engines").items()}


def choose_engine_name(config: ServerConfig) -> str:
    from trtserver.engine.trtllm import trtllm_unavailable_reason

    if config.engine == "trtllm":
        reason = trtllm_unavailable_reason(config, allow_hf_checkpoint=True)
        if reason is not None:
            raise EngineSelectionError(f"--engine trtllm cannot run here: {reason} (use --engine auto or torch)")
    if config.engine != "auto":
        return config.engine

    reason = trtllm_unavailable_reason(config)
    if reason is None:
        return "trtllm"
    log.info("engine_auto_selected", engine="torch", why_not_trtllm=reason)
    return "torch"


def build_engine(config: ServerConfig, pm: pluggy.PluginManager) -> Engine:
    engines = registered_engines(pm)
    name = choose_engine_name(config)
    factory = engines.get(name)
    if factory is None:
        raise EngineSelectionError(f"unknown engine {name!r}; registered engines: {', '.join(sorted(engines))}")
    return factory(config)
