"""How steady each server's throughput is: the same closed-loop load, round after round, ours and llama-server in
turn, each round's aggregate tokens/s printed and the worst round against the best.

    .venv/bin/python -m bench.steadiness [--streams 16] [--rounds 6] [--tokens 64] [--busy-neighbour]

Both servers are up together and idle while the other runs; the order alternates from round to round. A server
whose worst round is far below its best (its threads contending with a neighbour, or with each other) shows it
here where a median over rounds hides it. The load average is printed beside each round: a busy machine lowers
every server's rounds alike. ``--busy-neighbour`` runs a process that spins on one core throughout, as another
program on an edge box would.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys

from bench import peers
from bench.client import run_load
from bench.harness import DEFAULT_ENGINE
from bench.prompts import SHORT
from bench.rounds import model_name

EXTRA = {"stream_options": {"include_usage": True}, "ignore_eos": True}


async def rounds(servers: list[peers.Server], args: argparse.Namespace) -> dict[str, list[float]]:
    models = {s.name: model_name(s.base_url) for s in servers}
    for s in servers:  # warm-up
        await run_load(s.base_url, models[s.name], SHORT, 8, args.streams, 1, extra=EXTRA)
    figures: dict[str, list[float]] = {s.name: [] for s in servers}
    for i in range(args.rounds):
        for s in servers if i % 2 == 0 else servers[::-1]:
            result = await run_load(s.base_url, models[s.name], SHORT, args.tokens, args.streams, 1, extra=EXTRA)
            if result.failures:
                raise RuntimeError(f"{s.name}: {result.failures} streams failed")
            figures[s.name].append(result.agg_tps)
            print(f"[steadiness] round {i + 1}/{args.rounds} {s.name}: {result.agg_tps:.1f} tokens/s "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ours-args", default="", help="extra flags for `trtserver serve` (space-separated)")
    ap.add_argument("--busy-neighbour", action="store_true", help="a process spinning on one core throughout")
    args = ap.parse_args()
    binary, gguf = peers.ensure_llama_server(), peers.find_gguf()
    ours = peers.ours(DEFAULT_ENGINE, peers.free_port(), extra=args.ours_args.split())
    peer = peers.llama_server(binary, gguf, peers.free_port(), slots=args.streams, threads=os.cpu_count() or 1)
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy_neighbour else None
    try:
        with ours, peer:
            ours.start()
            peer.start()
            figures = asyncio.run(rounds([ours, peer], args))
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    busy = ", a neighbour spinning on one core" if neighbour is not None else ""
    print(f"\n{args.streams} streams, {args.tokens} tokens each, {args.rounds} alternated rounds{busy}")
    print("| server | median tokens/s | best | worst | worst / best |")
    print("|---|---:|---:|---:|---:|")
    for name, values in figures.items():
        print(f"| {name} | {statistics.median(values):.1f} | {max(values):.1f} | {min(values):.1f} | "
              f"{min(values) / max(values):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
