"""Fused CPU kernels for the small-batch decode (``kernels.cpp``), built on this machine on first use.

``torch.utils.cpp_extension`` compiles them with the system's C++ compiler (~30 s, once; torch caches
the build under ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``, keyed by the
source) and registers them as ``torch.ops.trtserver.*``, which TorchScript can call. ``make engines``
builds them, so a server's start-up only loads the cached library. Where there is no compiler, or
the build fails, the scripted decode issues the same work as ATen calls (``scripted.py``).

    python -m trtserver.engine.torch.kernels     # build (or find) them; exits 1 if they cannot be built
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.cpp")
OPS = ("rms_norm", "rope_cache", "decode_attention")


def loaded() -> bool:
    namespace = torch.ops.trtserver
    try:
        return all(hasattr(namespace, op) for op in OPS)
    except RuntimeError:  # torch < 2.x raises for an unknown op instead of AttributeError
        return False


def build_target() -> tuple[str, list[str]]:
    """The extension's name and compiler flags. On x86-64 Linux the build targets this CPU (AVX2 / AVX-512
    for the attention's dot products), so the name carries a digest of the CPU's model and flags: a
    home directory shared by different machines never hands one a library built for another."""
    flags = ["-O3", "-fopenmp-simd"]
    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() in ("x86_64", "AMD64") and cpuinfo.exists():
        lines = [line for line in cpuinfo.read_text(errors="replace").splitlines()
                 if line.startswith(("model name", "flags"))][:2]
        digest = hashlib.sha1("\n".join(lines).encode()).hexdigest()[:10]
        return f"trtserver_kernels_{digest}", [*flags, "-march=native"]
    return "trtserver_kernels", flags


def _ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; the pip-installed one sits in this environment's bin folder, which
    is on PATH only where the environment is activated."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def load(*, verbose: bool = False) -> bool:
    """Build or load the kernels into this process; False (and a warning) where they cannot be."""
    if loaded():
        return True
    t0 = time.perf_counter()
    _ninja_on_path()
    try:
        from torch.utils.cpp_extension import load as build

        name, flags = build_target()
        build(name=name, sources=[str(SOURCE)], extra_cflags=flags, is_python_module=False, verbose=verbose)
    except Exception as exc:  # noqa: BLE001 - no compiler, no headers, a failed build: the ATen path runs
        log.warning("fused CPU kernels unavailable (%s); the decode issues them as ATen calls", exc)
        return False
    log.info("fused CPU kernels loaded in %.1fs", time.perf_counter() - t0)
    return loaded()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ok = load()
    print("trtserver fused CPU kernels:", "ready" if ok else "not available (the decode runs without them)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
