"""Whether TensorRT-LLM can serve an engine directory here, decided without importing it."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from trtserver.engine.trtllm.version import parse_release
from trtserver.manifest import ManifestError, load_manifest

if TYPE_CHECKING:
    from trtserver.config import ServerConfig

__all__ = ["installed_trtllm_version", "trtllm_unavailable_reason"]


def installed_trtllm_version() -> str | None:
    """The installed distribution's version, read from metadata without importing it."""
    for dist in ("tensorrt_llm", "tensorrt-llm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def trtllm_unavailable_reason(config: ServerConfig, *, allow_hf_checkpoint: bool = False) -> str | None:
    """Why ``--engine auto`` must not pick TensorRT-LLM for ``config``; None when it can.

    Never imports ``tensorrt_llm``; imports torch only to ask for CUDA. ``allow_hf_checkpoint``
    accepts an engine directory without a TensorRT engine (TRT-LLM 1.x's PyTorch backend), which
    ``--engine trtllm`` may do but ``auto`` should not.
    """
    if importlib.util.find_spec("tensorrt_llm") is None:
        return "TensorRT-LLM is not installed"
    if importlib.util.find_spec("torch") is None:
        return "PyTorch (which TensorRT-LLM needs) is not importable"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    try:
        manifest = load_manifest(config.engine_dir)
    except ManifestError as exc:
        return str(exc)
    installed = installed_trtllm_version()
    if manifest.trtllm is None:
        if allow_hf_checkpoint and installed is not None and parse_release(installed) >= (1, 0, 0):
            return None
        return (f"{config.engine_dir} holds no TensorRT-LLM engine (manifest has no trtllm entry); "
                "run `make engines` on a machine with TensorRT-LLM")
    engine = Path(config.engine_dir) / manifest.trtllm.engine_dir
    if not (engine / "config.json").is_file():
        return f"{engine}/config.json is missing: the TensorRT-LLM engine directory is incomplete"
    if installed is not None and installed != manifest.trtllm.version:
        return (f"the engine was built with TensorRT-LLM {manifest.trtllm.version} but {installed} is "
                "installed; engines only load in the version that built them: rebuild with `make engines`")
    return None
