"""TensorRT-LLM engine build on top of a portable engine directory (``make engines``).

The portable directory is a Hugging Face Llama-family checkpoint (safetensors + config.json +
tokenizer). Where TensorRT-LLM and a CUDA GPU exist, this builds ``<engine_dir>/trtllm/`` with
either TensorRT-LLM's two-step CLI (``convert_checkpoint.py`` from its examples, then
``trtllm-build``) when the example script is found, or the LLM API (``LLM(model, build_config=…)``
then ``save()``). Both run in a subprocess with a time limit, so a CUDA or MPI failure cannot take
the builder down. The result (version, relative dir, build arguments) goes into ``manifest.trtllm``.
Without TensorRT-LLM this prints one line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trtserver.manifest import Manifest, TrtllmBuild

ENGINE_SUBDIR = "trtllm"
EXAMPLE_PATHS = ("models/core/llama/convert_checkpoint.py", "llama/convert_checkpoint.py")  # 1.x, ≤0.19
DEFAULT_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class TrtllmBuildOptions:
    enabled: bool = True
    max_batch_size: int = 64
    max_input_len: int = 4096
    max_seq_len: int = 8192
    dtype: str = "auto"
    gather_context_logits: bool = False


def _have_trtllm() -> bool:
    return importlib.util.find_spec("tensorrt_llm") is not None


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def _trtllm_version() -> str:
    from trtserver.engine.trtllm import installed_trtllm_version

    version = installed_trtllm_version()
    if version is None:  # not installed as a distribution (a source checkout): ask the module
        out = _run([sys.executable, "-c", "import tensorrt_llm; print(tensorrt_llm.__version__)"], 600)
        version = out.strip().splitlines()[-1]
    return version


def _run(cmd: list[str], timeout: float) -> str:
    print("+ " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-4000:]
        raise RuntimeError(f"{Path(cmd[1] if cmd[0] == sys.executable else cmd[0]).name} failed "
                           f"(exit {done.returncode}):\n{tail}")
    return done.stdout


def find_convert_script() -> Path | None:
    """TensorRT-LLM's Llama ``convert_checkpoint.py``: $TRTLLM_EXAMPLES_DIR, then the container's copy."""
    roots = [os.environ.get("TRTLLM_EXAMPLES_DIR"), "/app/tensorrt_llm/examples",
             "/opt/tensorrt_llm/examples"]
    for root in roots:
        for rel in EXAMPLE_PATHS:
            if root and (Path(root) / rel).is_file():
                return Path(root) / rel
    return None


def resolve_args(manifest: Manifest, options: TrtllmBuildOptions) -> dict[str, Any]:
    dtype = options.dtype
    if dtype == "auto":  # TensorRT engines are built in half precision unless asked otherwise
        dtype = "bfloat16" if manifest.dtype == "bfloat16" else "float16"
    max_seq_len = min(options.max_seq_len, manifest.context_length)
    return {
        "dtype": dtype,
        "max_batch_size": options.max_batch_size,
        "max_input_len": min(options.max_input_len, max_seq_len),
        "max_seq_len": max_seq_len,
        "gather_context_logits": options.gather_context_logits,
    }


def cli_commands(source: Path, ckpt: Path, out: Path, script: Path, args: dict[str, Any]) -> list[list[str]]:
    convert = [sys.executable, str(script), "--model_dir", str(source), "--output_dir", str(ckpt),
               "--dtype", args["dtype"]]
    build = ["trtllm-build", "--checkpoint_dir", str(ckpt), "--output_dir", str(out),
             "--max_batch_size", str(args["max_batch_size"]), "--max_input_len", str(args["max_input_len"]),
             "--max_seq_len", str(args["max_seq_len"]),
             "--gemm_plugin", "auto", "--gpt_attention_plugin", "auto"]
    if args["gather_context_logits"]:
        build.append("--gather_context_logits")
    return [convert, build]


LLM_API_SCRIPT = """
import json, sys
args = json.loads(sys.argv[1])
from tensorrt_llm import BuildConfig
try:
    from tensorrt_llm._tensorrt_engine import LLM   # 1.x: tensorrt_llm.LLM is the PyTorch backend
except ImportError:
    from tensorrt_llm import LLM                     # 0.x: the TensorRT engine class
bc = BuildConfig()
for name in ("max_batch_size", "max_input_len", "max_seq_len", "gather_context_logits"):
    setattr(bc, name, args[name])
if __name__ == "__main__":
    llm = LLM(model=args["source"], build_config=bc, dtype=args["dtype"])
    llm.save(args["out"])
    llm.shutdown()
"""


def maybe_build_trtllm(engine_dir: Path, manifest: Manifest,
                       options: TrtllmBuildOptions) -> TrtllmBuild | None:
    """Build a TensorRT-LLM engine under ``engine_dir`` when TensorRT-LLM is installed.

    ``engine_dir`` is the (staging) engine directory holding the portable checkpoint; the result's
    ``engine_dir`` is relative to it. Returns None when nothing was built.
    """
    if not options.enabled:
        return None
    if not _have_trtllm():
        print("TensorRT-LLM not installed: built only the portable engine directory")
        return None
    if not _cuda_available():
        print("TensorRT-LLM is installed but no CUDA device is visible: built only the portable engine "
              "directory")
        return None
    engine_dir = Path(engine_dir)
    out = engine_dir / ENGINE_SUBDIR
    args = resolve_args(manifest, options)
    timeout = float(os.environ.get("TRTLLM_BUILD_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    started = time.monotonic()
    try:
        version = _trtllm_version()
        shutil.rmtree(out, ignore_errors=True)
        script = find_convert_script()
        if script is not None and shutil.which("trtllm-build"):
            method = "convert_checkpoint+trtllm-build"
            with tempfile.TemporaryDirectory(prefix="trtllm-ckpt-", dir=engine_dir.parent) as ckpt:
                for cmd in cli_commands(engine_dir, Path(ckpt), out, script, args):
                    _run(cmd, timeout)
        else:
            method = "llm-api"
            payload = json.dumps({**args, "source": str(engine_dir), "out": str(out)})
            _run([sys.executable, "-c", LLM_API_SCRIPT, payload], timeout)
        if not (out / "config.json").is_file():
            raise RuntimeError(f"the build finished but {out}/config.json is missing")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        shutil.rmtree(out, ignore_errors=True)
        print(f"TensorRT-LLM engine build FAILED; kept the portable engine directory (serve it with "
              f"--engine torch):\n{exc}", file=sys.stderr)
        if os.environ.get("TRTLLM_BUILD_REQUIRED") == "1":
            raise
        return None
    print(f"Built the TensorRT-LLM {version} engine in {time.monotonic() - started:.0f}s ({method})")
    return TrtllmBuild(version=version, engine_dir=ENGINE_SUBDIR,
                       build_args={**args, "method": method, "options": asdict(options)})
