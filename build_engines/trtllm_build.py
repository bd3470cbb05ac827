"""TensorRT-LLM engine build from a portable engine directory (placeholder until implemented)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from trtserver.manifest import Manifest, TrtllmBuild


@dataclass(frozen=True)
class TrtllmBuildOptions:
    enabled: bool = True
    max_batch_size: int = 64
    max_input_len: int = 4096
    max_seq_len: int = 8192
    dtype: str = "auto"
    gather_context_logits: bool = False


def maybe_build_trtllm(
    engine_dir: Path, manifest: Manifest, options: TrtllmBuildOptions
) -> TrtllmBuild | None:
    """Build a TensorRT-LLM engine under ``engine_dir`` when TensorRT-LLM is installed.

    ``engine_dir`` is the (staging) engine directory holding the portable checkpoint; the result's
    ``engine_dir`` is relative to it. Returns None when nothing was built.
    """
    if not options.enabled:
        return None
    if importlib.util.find_spec("tensorrt_llm") is None:
        print("TensorRT-LLM not installed: built only the portable engine directory")
        return None
    raise NotImplementedError("TensorRT-LLM engine build is not implemented yet")
