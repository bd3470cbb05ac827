"""Service tiers under load: does a ``flex`` flood slow the ``default`` tier down?

    .venv/bin/python -m bench.tiers                        # 40 s per phase
    .venv/bin/python -m bench.tiers --seconds 20 --flex-clients 8

One server, three phases with the same default-tier load (``--default-clients`` closed-loop streams
of ``--default-tokens`` tokens, ``service_tier: "default"``):

1. ``baseline``      the default-tier clients alone;
2. ``flex flood``    plus ``--flex-clients`` closed-loop clients with ``service_tier: "flex"``
                     (engine priority LOWEST);
3. ``default flood`` the same flood sent as ``service_tier: "default"`` (priority NORMAL, the
                     control: what the flood costs when it does NOT yield).

Priority only decides admission from the waiting queue (a running sequence is never preempted),
so the setup makes the queue matter: ``--max-batch-size`` (4) is smaller than the flood, the flood
keeps the queue full, and flex requests are short (``--flex-tokens`` 16) so a slot frees often.
A default request then waits for the next free slot only, instead of behind the whole flood; it
still shares every decode step with the running flex sequences (a fuller batch), which is the part
of the slow-down priority cannot remove. Pass: flex-flood p50 and p95 latency within 1.2x baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.soak import ENGINE_DIR, ServerProcess, pct, scrape, sse_events

PROMPTS = ("Write a short note about rivers.", "List three colours:", "The capital of France is",
           "Once upon a time, in a small village,")


@dataclass
class Samples:
    latency: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    tiers: set[str] = field(default_factory=set)

    def row(self, name: str, baseline: Samples | None) -> str:
        p50, p95 = pct(self.latency, 50), pct(self.latency, 95)
        t50, t95 = pct(self.ttft, 50), pct(self.ttft, 95)
        ratio = f"{p50 / pct(baseline.latency, 50):.2f} / {p95 / pct(baseline.latency, 95):.2f}" if baseline else "-"
        return (f"| {name:13} | {len(self.latency):5d} | {p50:6.2f} | {p95:6.2f} | {t50:6.2f} | {t95:6.2f} | "
                f"{ratio:12} | {len(self.errors):4d} |")


async def one(session: aiohttp.ClientSession, base: str, tier: str, tokens: int, prompt: str,
              samples: Samples) -> None:
    body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "service_tier": tier}
    t0 = time.monotonic()
    ttft = None
    try:
        async with session.post(f"{base}/v1/completions", json=body) as response:
            if response.status != 200:
                samples.errors.append(f"HTTP {response.status}: {(await response.text())[:200]}")
                await asyncio.sleep(0.5)
                return
            last = ""
            async for event in sse_events(response):
                if ttft is None:
                    ttft = time.monotonic() - t0
                if event != "[DONE]":
                    chunk = json.loads(event)
                    samples.tiers.add(str(chunk.get("service_tier")))
                    if chunk.get("usage") is not None and chunk["usage"]["completion_tokens"] != tokens:
                        samples.errors.append(f"usage {chunk['usage']}")
                last = event
        if last != "[DONE]":
            samples.errors.append("stream without [DONE]")
            return
    except (aiohttp.ClientError, TimeoutError) as exc:
        samples.errors.append(f"{type(exc).__name__}: {exc}")
        return
    samples.latency.append(time.monotonic() - t0)
    samples.ttft.append(ttft or float("nan"))


async def loop(base: str, tier: str, tokens: int, until: float, samples: Samples, index: int) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        step = index
        while time.monotonic() < until:
            await one(session, base, tier, tokens, PROMPTS[step % len(PROMPTS)], samples)
            step += 1


async def phase(base: str, args: argparse.Namespace, flood_tier: str | None) -> tuple[Samples, Samples, float]:
    """Default-tier samples, flood samples, mean queue depth while it ran."""
    measured, flood = Samples(), Samples()
    start = time.monotonic()
    until = start + args.seconds
    flooders = []
    if flood_tier is not None:
        flooders = [asyncio.create_task(loop(base, flood_tier, args.flex_tokens, until + 5, flood, i))
                    for i in range(args.flex_clients)]
        await asyncio.sleep(args.settle)  # let the flood fill the batch and the queue first
    default_until = time.monotonic() + args.seconds
    clients = [asyncio.create_task(loop(base, "default", args.default_tokens, default_until, measured, i))
               for i in range(args.default_clients)]
    depths = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while not all(task.done() for task in clients):
            depths.append((await scrape(session, base)).get("trtserver_queue_depth", 0.0))
            await asyncio.sleep(0.5)
    await asyncio.gather(*clients)
    for task in flooders:
        task.cancel()
    await asyncio.gather(*flooders, return_exceptions=True)
    return measured, flood, sum(depths) / max(1, len(depths))


async def run(args: argparse.Namespace) -> int:
    flags = ["--max-model-len", "256", "--max-batch-size", str(args.max_batch_size)]
    server = ServerProcess(Path(args.engine_dir), flags, "tiers")
    results: dict[str, tuple[Samples, Samples, float]] = {}
    try:
        await server.wait_ready()
        print(f"server: {' '.join(server.command[1:])}", flush=True)
        warm = Samples()
        async with aiohttp.ClientSession() as session:
            for i in range(4):
                await one(session, server.base, "default", args.default_tokens, PROMPTS[i], warm)
        for name, tier in (("baseline", None), ("flex flood", "flex"), ("default flood", "default")):
            results[name] = await phase(server.base, args, tier)
            print(f"  {name}: {len(results[name][0].latency)} default-tier requests", flush=True)
            await asyncio.sleep(2)  # let the cancelled flood drain
    finally:
        server.stop()

    base = results["baseline"][0]
    print()
    print(f"tiers: --max-batch-size {args.max_batch_size}, {args.default_clients} default-tier clients x "
          f"{args.default_tokens} tokens, flood {args.flex_clients} clients x {args.flex_tokens} tokens, "
          f"{args.seconds:.0f} s per phase, load avg {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print()
    print("| phase         |     n |  p50 s |  p95 s | ttft50 | ttft95 | x base 50/95 | errs |")
    print("|---------------|-------|--------|--------|--------|--------|--------------|------|")
    for name, (measured, _, _) in results.items():
        print(measured.row(name, None if name == "baseline" else base))
    print()
    for name, (measured, flood, depth) in results.items():
        if name != "baseline":
            print(f"{name}: flood requests served {len(flood.latency)} (errors {len(flood.errors)}, tiers "
                  f"{sorted(flood.tiers)}), mean queue depth {depth:.1f}; default tiers {sorted(measured.tiers)}")
    errors = [e for measured, flood, _ in results.values() for e in measured.errors + flood.errors]
    for error in errors[:5]:
        print("  error:", error)
    flex = results["flex flood"][0]
    ratio50 = pct(flex.latency, 50) / pct(base.latency, 50)
    ratio95 = pct(flex.latency, 95) / pct(base.latency, 95)
    control = pct(results["default flood"][0].latency, 50) / pct(base.latency, 50)
    checks = {
        "flex flood: default-tier p50 within 1.2x baseline": ratio50 <= 1.2,
        "flex flood: default-tier p95 within 1.2x baseline": ratio95 <= 1.2,
        "no errors": not errors,
        "tiers as asked": results["flex flood"][1].tiers == {"flex"} and flex.tiers == {"default"},
    }
    print()
    print(f"ratio flex-flood / baseline: p50 {ratio50:.2f}, p95 {ratio95:.2f}; "
          f"default-tier flood (control) p50 {control:.2f}")
    for name, passed in checks.items():
        print(f"  {'PASS' if passed else 'FAIL'}  {name}")
    return 0 if all(checks.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tiers", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="measured seconds per phase")
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument("--default-clients", type=int, default=2)
    parser.add_argument("--default-tokens", type=int, default=48)
    parser.add_argument("--flex-clients", type=int, default=12)
    parser.add_argument("--flex-tokens", type=int, default=16)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds of flood before measuring")
    parser.add_argument("--engine-dir", default=str(ENGINE_DIR))
    return asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
