"""The harness's report: one ours/peer table per peer, the machine and code it ran on, GPU roofline facts."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from bench import peers
from bench.client import LoadResult

ROOT = peers.ROOT


PEAK_BW_GBS = [("GH200", 4000.0), ("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
               ("B200", 8000.0), ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0),
               ("L40S", 864.0), ("L40", 864.0), ("L4", 300.0), ("A10G", 600.0), ("A10", 600.0),
               ("RTX 4090", 1008.0), ("RTX 3090", 936.0), ("T4", 320.0)]


@dataclass
class ServerRun:
    name: str
    startup_s: float = float("nan")
    rss_peak: int = 0
    rss_idle: int = 0
    loads: dict[str, LoadResult] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)  # the server's CPU seconds per scenario
    main_cpu_s: dict[str, float] = field(default_factory=dict)  # of which its main (event-loop) thread
    notes: list[str] = field(default_factory=list)
    profile: dict[int, str] = field(default_factory=dict)  # streams -> py-spy summary


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def weight_params(engine_dir: Path) -> int:
    total = 0
    for f in sorted(engine_dir.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                total += int(math.prod(meta["shape"]))
    return total


def gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
        return out[0] if out else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


def default_peak_bw(name: str) -> float | None:
    for key, bw in PEAK_BW_GBS:
        if key.lower() in name.lower():
            return bw
    return None


def fmt(x: float, spec: str = ".1f") -> str:
    return "n/a" if x != x else format(x, spec)  # NaN check


def ratio(a: float, b: float) -> float:
    return a / b if b and a == a and b == b else float("nan")


def peer_sections(ours: ServerRun, peer_runs: list[ServerRun]) -> list[tuple[str, list[str]]]:
    """One (title, table) per peer, in the order they ran; ours alone when there is none."""
    if not peer_runs:
        return [("Ours", build_table(ours, None))]
    return [(f"Ours against {peers.PEERS.get(run.name, run.name)}", build_table(ours, run, run.name))
            for run in peer_runs]


def build_table(ours: ServerRun, peer: ServerRun | None, peer_name: str = "peer") -> list[str]:
    """Ours against one peer server, scenario by scenario (the peer's column is ``-`` without one)."""
    rows = [f"| metric | ours | {peer_name} | ours/peer |", "|---|---:|---:|---:|"]

    def add(metric: str, a: float, b: float | None, spec: str = ".1f", target: str = "", higher: bool = True) -> None:
        r = ratio(a, b) if b is not None else float("nan")
        arrow = "" if r != r else (" ↑" if higher else " ↓")
        rows.append(f"| {metric} | {fmt(a, spec)} | {fmt(b, spec) if b is not None else '-'} | "
                    f"{fmt(r, '.2f')}×{arrow} |")

    p = peer
    add("start-up to ready (s)", ours.startup_s, p.startup_s if p else None, ".2f", "ours < 10 s", higher=False)
    add("RSS when ready, idle (MiB)", ours.rss_idle / 2**20, p.rss_idle / 2**20 if p else None, ".0f", higher=False)
    add("RSS peak (MiB)", ours.rss_peak / 2**20, p.rss_peak / 2**20 if p else None, ".0f", "ours < 1536 MiB",
        higher=False)
    for name, load in ours.loads.items():
        pl = p.loads.get(name) if p else None
        target = ""
        if name.startswith("16 streams"):
            target = "≥ 5× peer"
        add(f"{name}: aggregate tokens/s", load.agg_tps, pl.agg_tps if pl else None, ".1f", target)
        add(f"{name}: per-stream decode tokens/s", load.per_stream_tps, pl.per_stream_tps if pl else None, ".1f",
            "≥ 1.0× peer" if name.startswith("1 stream") else "")
        cpu = ours.cpu_s.get(name, 0.0)
        pcpu = p.cpu_s.get(name, 0.0) if p else 0.0
        add(f"{name}: tokens per server CPU-second", load.tokens / cpu if cpu else float("nan"),
            (pl.tokens / pcpu if pcpu else float("nan")) if pl else None, ".1f")
        add(f"{name}: TTFT p50 (ms)", 1000 * load.pct("ttft_s", 50), 1000 * pl.pct("ttft_s", 50) if pl else None,
            ".0f", higher=False)
        if load.streams > 1:
            add(f"{name}: TTFT p99 (ms)", 1000 * load.pct("ttft_s", 99),
                1000 * pl.pct("ttft_s", 99) if pl else None, ".0f", higher=False)
        add(f"{name}: latency p50 (s)", load.pct("latency_s", 50), pl.pct("latency_s", 50) if pl else None, ".2f",
            higher=False)
        add(f"{name}: latency p99 (s)", load.pct("latency_s", 99), pl.pct("latency_s", 99) if pl else None, ".2f",
            higher=False)
    return rows


def vector_isa(flags: set[str]) -> str:
    """The widest vector extensions the engine's CPU kernels can use here."""
    if "avx512_bf16" in flags:
        return "AVX-512 BF16"
    if "avx512f" in flags:
        return "AVX-512"
    if "avx2" in flags:
        return "AVX2, no AVX-512"
    return "no AVX2"


def machine_label(device: str) -> str:
    """A file name for this machine's results: the GPU, or the CPU with its core count and vector ISA."""
    if device != "cpu":
        name = gpu_name() or "gpu"
    else:
        cpu, flags = peers.cpuinfo()
        isa = "avx512" if "avx512f" in flags else ("avx2" if "avx2" in flags else "")
        name = f"{cpu or platform.machine()} {os.cpu_count()}c {isa}"
    return re.sub(r"[^a-z0-9]+", "-", name.lower().replace("(r)", "").replace("(tm)", "")).strip("-")


def machine_line(args: argparse.Namespace) -> str:
    cpu, flags = peers.cpuinfo()
    import torch

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = f", GPU {gpu_name()}" if args.device != "cpu" else ""
    return (f"{os.cpu_count()} CPU cores ({cpu or platform.machine()}, {vector_isa(flags)}), {mem:.0f} GiB RAM{gpu}; "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def git_revision() -> str:
    """The checkout's commit, and whether trtserver/ differs from it."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30,
                             cwd=ROOT).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "trtserver"], capture_output=True, text=True,
                               timeout=30, cwd=ROOT).stdout.split("\n")
        changed = [line[3:] for line in dirty if line.strip()]
        return rev + (f" + uncommitted changes in {', '.join(changed)}" if changed else " (trtserver/ clean)")
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def llamacpp_version(py: Path) -> str:
    try:
        return subprocess.run([str(py), "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
                              text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"
