"""Replicas behind nginx, quotas in Redis: what scaling out costs on this machine.

Starts a redis-server, two replicas of the same size (``--threads`` = CPUs / 2 each, the Redis quota
plugin on) and nginx in front, configured as docs/deploy.md recommends, then measures:

1. aggregate tokens/s of ``--streams`` concurrent streams sent to one replica directly (the other
   idle), then the same load through nginx over both;
2. the proxy's cost per streamed token: nginx's worker CPU time per token relayed, and the median
   gap between chunks at one stream, through nginx against direct, each against the decode step
   (that gap, direct);
3. the quota check's latency: ``RedisQuotaStore.acquire`` and ``add_tokens`` on loopback
   (p50/p99 over ``--quota-samples`` calls) against the in-memory store.

    .venv/bin/python -m bench.replicas                     # about two minutes on two cores
    .venv/bin/python -m bench.replicas --streams 8 --tokens 64 --out bench/out/replicas.json

Needs Debian's redis-server and nginx (``make install`` adds them). Other load on the machine moves
the numbers; the load average is printed with them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from trtserver_redis_quota.settings import RedisQuotaSettings
from trtserver_redis_quota.store import RedisQuotaStore
from trtserver_redis_quota.testing import RedisServer

from bench.client import LoadResult, run_load
from tests.http.conftest import wait_healthy
from tests.replicas.deployment import Nginx, Replica
from trtserver.config import TierLimits
from trtserver.quota import MemoryQuotaStore

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Once upon a time, in a land far away,"
EXTRA = {"ignore_eos": True, "stream_options": {"include_usage": True}}


def replica_config(path: Path, redis_url: str) -> Path:
    path.write_text(f"""[server]
[server.quotas.default]  # every request is checked and charged
requests_per_minute = 1000000
tokens_per_minute = 1000000000

[plugins]
load = ["trtserver_redis_quota"]

[plugins.redis_quota]
url = "{redis_url}"
key_prefix = "bench:"
""")
    return path


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()] if path.exists() else []


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


async def load(base: str, model: str, tokens: int, streams: int, per_stream: int) -> LoadResult:
    result = await run_load(base, model, PROMPT, tokens, streams, per_stream, extra=EXTRA)
    if result.failures:
        raise RuntimeError(f"{result.failures} of {len(result.results)} streams failed: "
                           f"{next(r.error for r in result.results if not r.ok)}")
    return result


async def quota_latency(url: str, samples: int) -> dict[str, float]:
    """Seconds per call, p50 and p99, of the Redis store and of the in-memory one; and of a bare PING on the
    store's own connection, the round trip every Redis call pays (the floor the machine sets)."""
    store, memory = RedisQuotaStore(RedisQuotaSettings(url=url, key_prefix="bench-quota:")), MemoryQuotaStore()
    limits = TierLimits(requests_per_minute=samples * 10, tokens_per_minute=samples * 1000)
    timings: dict[str, list[float]] = {"redis_ping": [], "redis_acquire": [], "redis_add_tokens": [],
                                       "memory_acquire": []}
    try:
        for i in range(samples):
            project = f"p{i % 16}"
            t0 = time.perf_counter()
            await store.client.ping()
            t1 = time.perf_counter()
            await store.acquire(project, limits, 0.0)
            t2 = time.perf_counter()
            await store.add_tokens(project, 40, 0.0)
            t3 = time.perf_counter()
            memory.acquire(project, limits, time.monotonic())
            t4 = time.perf_counter()
            timings["redis_ping"].append(t1 - t0)
            timings["redis_acquire"].append(t2 - t1)
            timings["redis_add_tokens"].append(t3 - t2)
            timings["memory_acquire"].append(t4 - t3)
        if store.outage.failures:
            raise RuntimeError("the Redis store failed during the measurement")
    finally:
        await store.aclose()
    return {f"{name}_{q}_ms": percentile(values[samples // 10:], float(q[1:])) * 1000  # the first tenth warms up
            for name, values in timings.items() for q in ("p50", "p99")}


async def measure(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    model = Path(args.engine_dir).name
    threads = str(max(1, (os.cpu_count() or 2) // 2))
    flags = ("--threads", threads, "--no-pin-threads", "--max-model-len", "1024", "--log-level", "warning")
    out: dict[str, Any] = {"load_average_before": os.getloadavg()[0], "threads_per_replica": int(threads),
                           "streams": args.streams, "tokens": args.tokens}
    with RedisServer(root / "redis") as redis_server:
        replicas = [Replica(Path(args.engine_dir), replica_config(root / f"r{i}.toml", redis_server.url),
                            root / f"r{i}.log", flags) for i in range(2)]
        nginx = None
        try:
            for replica in replicas:
                wait_healthy(replica.base, replica.process, timeout=300)
            nginx = Nginx(root / "nginx", [replica.address for replica in replicas])
            direct, proxied = replicas[0].base, nginx.base
            for base in (direct, replicas[1].base, proxied):  # warm-up: every replica, and nginx's connections
                await load(base, model, 8, 2, 1)

            workers = children(nginx.process.pid)
            one = await load(direct, model, args.tokens, args.streams, args.per_stream)
            cpu0 = sum(cpu_seconds(pid) for pid in workers)
            two = await load(proxied, model, args.tokens, args.streams, args.per_stream)
            single_proxied = await load(proxied, model, args.tokens, 1, args.single)
            nginx_cpu = sum(cpu_seconds(pid) for pid in workers) - cpu0
            single_direct = await load(direct, model, args.tokens, 1, args.single)
            out["one_replica_direct_tps"] = one.agg_tps
            out["two_replicas_nginx_tps"] = two.agg_tps
            out["scale"] = two.agg_tps / one.agg_tps

            step = statistics.median(r.inter_chunk_s for r in single_direct.ok)
            gap = statistics.median(r.inter_chunk_s for r in single_proxied.ok)
            relayed = sum(r.chunks for r in two.ok + single_proxied.ok)
            out["decode_step_ms"] = step * 1000
            out["proxied_chunk_gap_ms"] = gap * 1000
            # /proc counts CPU time in clock ticks: below one tick per run the figure is that bound
            tick = 1 / os.sysconf("SC_CLK_TCK")
            out["nginx_cpu_per_token_us"] = max(nginx_cpu, tick) / relayed * 1e6
            out["nginx_cpu_per_token_pct_of_step"] = 100 * max(nginx_cpu, tick) / relayed / step
            out["nginx_cpu_bound_only"] = nginx_cpu < tick
            out["ttft_direct_ms"] = statistics.median(r.ttft_s for r in single_direct.ok) * 1000
            out["ttft_nginx_ms"] = statistics.median(r.ttft_s for r in single_proxied.ok) * 1000

            out |= await quota_latency(redis_server.url, args.quota_samples)
            for replica in replicas:
                text = httpx.get(f"{replica.base}/metrics", timeout=10).text
                out.setdefault("replica_requests", []).append(
                    sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith("trtserver_requests_total{")))
        finally:
            if nginx is not None:
                nginx.stop()
            for replica in replicas:
                replica.stop()
    out["load_average_after"] = os.getloadavg()[0]
    return out


def report(r: dict[str, Any]) -> str:
    return "\n".join([
        f"load average {r['load_average_before']:.2f} before, {r['load_average_after']:.2f} after; "
        f"{r['threads_per_replica']} thread(s) per replica; {r['streams']} streams x {r['tokens']} tokens",
        f"aggregate: one replica direct {r['one_replica_direct_tps']:.1f} tok/s, two behind nginx "
        f"{r['two_replicas_nginx_tps']:.1f} tok/s ({r['scale']:.2f}x); requests per replica {r['replica_requests']}",
        f"one stream: decode step {r['decode_step_ms']:.2f} ms direct, chunk gap through nginx "
        f"{r['proxied_chunk_gap_ms']:.2f} ms; TTFT {r['ttft_direct_ms']:.1f} ms direct, "
        f"{r['ttft_nginx_ms']:.1f} ms through nginx",
        f"nginx: {'at most ' if r['nginx_cpu_bound_only'] else ''}{r['nginx_cpu_per_token_us']:.1f} us CPU "
        "per streamed token = "
        f"{r['nginx_cpu_per_token_pct_of_step']:.2f} % of a decode step",
        f"quota check: Redis acquire p50 {r['redis_acquire_p50_ms']:.3f} ms, p99 {r['redis_acquire_p99_ms']:.3f} ms; "
        f"add_tokens p99 {r['redis_add_tokens_p99_ms']:.3f} ms; "
        f"in-memory acquire p99 {r['memory_acquire_p99_ms']:.4f} ms; a bare Redis PING p50 "
        f"{r['redis_ping_p50_ms']:.3f} ms, p99 {r['redis_ping_p99_ms']:.3f} ms",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine-dir", default=str(ROOT / "engines" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--streams", type=int, default=4, help="concurrent streams for the aggregate rate")
    ap.add_argument("--per-stream", type=int, default=2, help="requests each stream sends, back to back")
    ap.add_argument("--tokens", type=int, default=32, help="max_tokens of every request (ignore_eos)")
    ap.add_argument("--single", type=int, default=3, help="one-stream requests, direct and through nginx")
    ap.add_argument("--quota-samples", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=None, help="also write the numbers here as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="trtserver-bench-replicas-") as tmp:
        result = asyncio.run(measure(args, Path(tmp)))
    print(report(result), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
