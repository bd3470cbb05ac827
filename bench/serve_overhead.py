"""Start-up, RSS and HTTP decode speed of `trtserver serve --engine torch`, per set of serve flags.

For each ``--variant`` (a string of extra serve flags), in one run: seconds from spawn to /health 200,
RSS once ready, then 1 stream and 16 concurrent streams of greedy completions (``ignore_eos``), the
aggregate tokens/s, tokens per server CPU-second, and the RSS after the load and its peak (VmHWM).

    .venv/bin/python -m bench.serve_overhead --variant "" --variant "--threads 1" --tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from bench.client import run_load
from bench.peers import stop_process

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Once upon a time, in a land far away,"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _proc(pid: int) -> tuple[float, float, float]:
    """(RSS MiB, peak RSS MiB, CPU seconds) of ``pid``."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return int(status["VmRSS"].split()[0]) / 1024, int(status["VmHWM"].split()[0]) / 1024, cpu


async def _wait_ready(base: str, proc: subprocess.Popen[bytes], timeout: float) -> float:
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                async with session.get(f"{base}/health") as resp:
                    if resp.status == 200:
                        return time.perf_counter() - t0
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise TimeoutError("server not ready")


async def measure(engine_dir: str, flags: str, tokens: int) -> dict[str, float]:
    port = _free_port()
    cmd = [sys.executable, "-m", "trtserver.cli", "serve", engine_dir, "--engine", "torch", "--port", str(port),
           "--log-format", "console", *shlex.split(flags)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    out: dict[str, float] = {}
    try:
        await _wait_ready(base, proc, 300)
        out["ready_s"] = time.perf_counter() - t0
        out["rss_ready_mib"] = _proc(proc.pid)[0]
        extra = {"ignore_eos": True, "stream_options": {"include_usage": True}}
        model = Path(engine_dir).name
        await run_load(base, model, PROMPT, 8, 1, 1, extra=extra)  # warm-up
        for streams, per in ((1, 2), (16, 1)):
            cpu0 = _proc(proc.pid)[2]
            load = await run_load(base, model, PROMPT, tokens, streams, per, extra=extra)
            cpu = _proc(proc.pid)[2] - cpu0
            total = sum(r.tokens for r in load.results if r.ok)
            out[f"tps_{streams}"] = total / load.wall_s
            out[f"tpcpu_{streams}"] = total / max(cpu, 1e-9)
        out["rss_after_mib"], out["rss_peak_mib"], _ = _proc(proc.pid)
    finally:
        stop_process(proc)
    return out


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine-dir", default=str(ROOT / "engines" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--variant", action="append", default=None, help="extra serve flags (repeatable)")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    for flags in args.variant or [""]:
        r = await measure(args.engine_dir, flags, args.tokens)
        print(f"[{flags or 'defaults'}] ready {r['ready_s']:.1f} s, RSS ready {r['rss_ready_mib']:.0f} MiB, "
              f"after {r['rss_after_mib']:.0f} MiB, peak {r['rss_peak_mib']:.0f} MiB | "
              f"1 stream {r['tps_1']:.1f} tok/s ({r['tpcpu_1']:.1f}/CPU-s) | "
              f"16 streams {r['tps_16']:.1f} tok/s ({r['tpcpu_16']:.1f}/CPU-s)", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
