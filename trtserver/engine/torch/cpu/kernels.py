"""Fused CPU kernels for the decode (``kernels.cpp``; the int4 projection, ``int4.cpp``), built on this machine on
first use.

``torch.utils.cpp_extension`` compiles them once with the system's C++ compiler and ninja into
``TORCH_EXTENSIONS_DIR`` (by default ``~/.cache/torch_extensions``), under a name that digests the source,
torch's version and the CPU, so a library is only ever loaded by the build it was made for. They register as
``torch.ops.trtserver.*``, which TorchScript can call. ``make engines`` builds them, so a server's start-up
only loads the library. Where no library is there yet, the build runs in a child process with a
time limit: a compiler that hangs, or a build lock left by a killed build, costs the engine its kernels,
never its start. Without them the scripted decode issues the same work as ATen calls (``scripted.py``).

    python -m trtserver.engine.torch.cpu.kernels     # build (or find) them; exits 1 if they cannot be built
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("kernels.cpp", "int4.cpp", "decode_stack.cpp", "top_k.cpp"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("checks.h", "vector_exp.h", "int4.h", "kernel_rows.h"))
OPS = ("rms_norm", "rope_cache", "decode_attention", "int4_linear", "int4_gated_linear", "int4_decode_layers",
       "top_k_indices", "int4_wide_from_rows")
BUILD_TIMEOUT_S = 300.0
AMX_OFF = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")  # where the compiler knows them (_no_amx_flags)
STALE_LOCK_S = 900.0  # a build lock older than this was left by a build that died
MODULE = "trtserver.engine.torch.cpu.kernels"  # the child that builds them


def loaded() -> bool:
    namespace = torch.ops.trtserver
    try:
        return all(hasattr(namespace, op) for op in OPS)
    except RuntimeError:  # torch < 2.x raises for an unknown op instead of AttributeError
        return False


def build_target() -> tuple[str, list[str]]:
    """The library's name and compiler flags. On x86-64 Linux the build targets this CPU (AVX2 / AVX-512 for
    the attention's dot products), so the CPU's model and flags are part of the name, with the source and
    torch's version: a home directory shared by different machines or environments never hands one a
    library built for another."""
    flags = ["-O3", "-fopenmp-simd", "-ffp-contract=off"]  # no fused multiply-adds the eager ops would round apart
    if sys.platform.startswith("linux") and torch.backends.openmp.is_available():
        flags.append("-fopenmp")  # at::parallel_for (the attention over long contexts) runs on one thread without it
    key = [*(path.read_bytes() for path in (*SOURCES, *HEADERS)), torch.__version__.encode(),
           str(torch.compiled_with_cxx11_abi()).encode()]
    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() in ("x86_64", "AMD64") and cpuinfo.exists():
        lines = [line for line in cpuinfo.read_text(errors="replace").splitlines()
                 if line.startswith(("model name", "flags"))][:2]
        key.append("\n".join(lines).encode())
        flags.append("-march=native")
    key.append(" ".join([*flags, *AMX_OFF]).encode())
    return f"trtserver_kernels_{hashlib.sha1(b'|'.join(key)).hexdigest()[:12]}", flags


def _no_amx_flags() -> list[str]:
    """AMX off where the compiler knows it: some machines report AMX whose tile instructions die with
    SIGILL, and ``-march=native`` alone would allow them. A compiler older than AMX never emits it."""
    compiler = os.environ.get("CXX", "c++")
    try:
        probe = subprocess.run([compiler, *AMX_OFF, "-fsyntax-only", "-x", "c++", "-"], input=b"",
                               capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return list(AMX_OFF) if probe.returncode == 0 else []


def build_directory(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    return Path(root) / "trtserver" / name


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


def build(*, verbose: bool = False) -> Path:
    """Compile the library in this process (raises on failure); returns its path."""
    from torch.utils.cpp_extension import load as compile_and_load

    name, flags = build_target()
    if "-march=native" in flags:
        flags += _no_amx_flags()
    directory = build_directory(name)
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"  # torch's build lock: a build killed midway leaves it, and the next waits forever
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    _ninja_on_path()
    compile_and_load(name=name, sources=[str(path) for path in SOURCES], extra_cflags=flags,
                     build_directory=str(directory), extra_ldflags=[flag for flag in flags if flag == "-fopenmp"],
                     is_python_module=False, verbose=verbose)
    return directory / f"{name}.so"


def load(*, timeout_s: float = BUILD_TIMEOUT_S) -> bool:
    """Load the kernels into this process, building them first (in a child, within ``timeout_s``) where
    they are not built yet; False, with a warning, where they cannot be had."""
    if loaded():
        return True
    t0 = time.perf_counter()
    name, _ = build_target()
    library = build_directory(name) / f"{name}.so"
    if not library.exists():
        child = subprocess.Popen([sys.executable, "-m", MODULE, "--build-only"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # the compiler and ninja too, not only the child
            child.communicate()
            log.warning("fused CPU kernels: the build took over %.0f s and was stopped; the decode issues "
                        "their work as ATen calls", timeout_s)
            return False
        if child.returncode != 0 or not library.exists():
            tail = output.strip().splitlines()[-3:]
            log.warning("fused CPU kernels unavailable (%s); the decode issues their work as ATen calls",
                        " / ".join(tail) or f"exit code {child.returncode}")
            return False
    try:
        torch.ops.load_library(str(library))
    except Exception as exc:  # noqa: BLE001 - a library that does not load leaves the ATen path
        log.warning("fused CPU kernels: %s did not load (%s); the decode issues their work as ATen calls", library, exc)
        return False
    log.info("fused CPU kernels loaded in %.1fs", time.perf_counter() - t0)
    return loaded()


def pick_int4_loop(packed: torch.Tensor, scales_mins: torch.Tensor, *, rounds: int = 7) -> int:
    """Which of ``int4.cpp``'s loops one row takes, for this process: the 256-bit and the 512-bit one timed in
    turn on one row of the given int4 projection (the model's largest, its head: what a decode step reads
    most of), the faster kept. The same bits either way. Returns the fewest rows that take the 512-bit loop;
    2 where the build has only the 256-bit one."""
    wide_from = torch.ops.trtserver.int4_wide_from_rows
    if wide_from(1) == 2:
        return 2
    x = torch.randn(1, packed.shape[1] * 32)
    times: dict[int, list[float]] = {1: [], 2: []}
    for round_ in range(rounds + 1):
        for rows in (1, 2):
            wide_from(rows)
            t0 = time.perf_counter()
            torch.ops.trtserver.int4_linear(x, packed, scales_mins)
            if round_:  # the first round warms both
                times[rows].append(time.perf_counter() - t0)
    best = min(times, key=lambda rows: sorted(times[rows])[rounds // 2])
    log.info("int4 kernel: one row on the %s-bit loop (median %.0f against %.0f us)", 512 if best == 1 else 256,
             sorted(times[best])[rounds // 2] * 1e6, sorted(times[3 - best])[rounds // 2] * 1e6)
    return int(wide_from(best))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args == ["--build-only"]:  # load()'s child
        build()
        return 0
    ok = load()
    print("trtserver fused CPU kernels:", "ready" if ok else "not available (the decode runs without them)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
