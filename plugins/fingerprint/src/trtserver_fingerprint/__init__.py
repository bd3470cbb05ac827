"""The built-in ``system_fingerprint``: ``fp_`` + 12 hex digits of a SHA-256 over what identifies
the running build.

Inputs: the engine's manifest facts (``EngineInfo.fingerprint_inputs``: served model name, weights
checksum, dtype, format and format version, the PyTorch engine's weight quantization and batch
invariance, or TensorRT-LLM's version and build arguments), the
backend name, and the installed versions of trtserver and of the runtime (``torch`` or
``tensorrt_llm``, read from package metadata; neither is imported). The same build restarted gives
the same fingerprint; changing any input changes it, as OpenAI's does when the backend changes.

The hook is ``trylast``: any other plugin that answers ``trtserver_system_fingerprint`` wins.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from typing import TYPE_CHECKING, Any

from trtserver import hookimpl

if TYPE_CHECKING:
    from trtserver.engine.base import EngineInfo

__version__ = "0.1.0"

RUNTIMES = {"torch": "torch", "trtllm": "tensorrt_llm"}
DIGITS = 12


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def fingerprint_facts(engine_info: EngineInfo) -> dict[str, Any]:
    """Everything the fingerprint is computed over, as a JSON-able dict."""
    facts: dict[str, Any] = {
        "manifest": engine_info.fingerprint_inputs,
        "backend": engine_info.backend,
        "trtserver": _version("trtserver"),
    }
    runtime = RUNTIMES.get(engine_info.backend)
    if runtime is not None:
        facts[runtime] = _version(runtime)
    return facts


def compute_fingerprint(facts: dict[str, Any]) -> str:
    canonical = json.dumps(facts, sort_keys=True, separators=(",", ":"), default=str)
    return "fp_" + hashlib.sha256(canonical.encode()).hexdigest()[:DIGITS]


@hookimpl(trylast=True)
def trtserver_system_fingerprint(engine_info: EngineInfo) -> str:
    return compute_fingerprint(fingerprint_facts(engine_info))
