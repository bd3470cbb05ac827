"""Event-loop CPU per streamed token, two builds of the server side by side: A from a git revision (checked out
into a worktree), B from this working tree. Both are up together and the rounds alternate A,B then B,A, so each
ratio compares figures taken seconds apart (this machine drifts by tens of percent over minutes).

    .venv/bin/python -m bench.loop_ab --base HEAD [--rounds 12] [--ours-args "..."]

Per request (one stream of 128 tokens, greedy, ``ignore_eos``): the CPU time of the server's main thread (its
event loop: HTTP, detokenizing, SSE) from ``/proc/PID/task/PID/schedstat``, divided by the tokens. Prints each
side's median and the per-round ratio B/A.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import peers
from bench.overhead import loop_cpu_ns

DEFAULT_ENGINE = peers.ROOT / "engines" / "SmolLM2-135M-Instruct"


def stream_once(port: int, tokens: int) -> None:
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True, "stream": True,
                       "temperature": 0})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        while response.read(65536):
            pass
    finally:
        conn.close()


def server(tree: Path, engine_dir: Path, extra: list[str]) -> peers.Server:
    """``trtserver serve`` running the code in ``tree``: run from there (``-m`` puts the working directory
    first on sys.path) and first on PYTHONPATH (for its engine process too)."""
    port = peers.free_port()
    cmd = [sys.executable, "-m", "trtserver.cli", "serve", str(engine_dir), "--host", "127.0.0.1", "--port",
           str(port), "--log-format", "json", *extra]
    return peers.Server(f"loop-ab-{tree.name}", cmd, port, "/health", env={"PYTHONPATH": str(tree)}, cwd=tree)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.loop_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="git revision for side A")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--engine-dir", type=Path, default=DEFAULT_ENGINE)
    ap.add_argument("--ours-args", default="", help="extra flags for both servers (space-separated)")
    args = ap.parse_args(argv)
    engine_dir = args.engine_dir.resolve()
    with tempfile.TemporaryDirectory(prefix="loop-ab-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), args.base], cwd=peers.ROOT,
                       check=True)
        try:
            sides = {"A": server(base, engine_dir, args.ours_args.split()),
                     "B": server(peers.ROOT, engine_dir, args.ours_args.split())}
            per: dict[str, list[float]] = {"A": [], "B": []}
            with sides["A"], sides["B"]:
                for side in sides.values():
                    side.start(timeout_s=180)
                    stream_once(side.port, args.tokens)  # warm-up, not counted
                for r in range(args.rounds):
                    for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                        side = sides[name]
                        assert side.proc is not None
                        before = loop_cpu_ns(side.proc.pid)
                        stream_once(side.port, args.tokens)
                        per[name].append((loop_cpu_ns(side.proc.pid) - before) / 1e6 / args.tokens)
                    print(f"[loop-ab] round {r + 1}: A {per['A'][-1]:.3f}  B {per['B'][-1]:.3f} ms/token", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=peers.ROOT, check=False)
    ratios = [b / a for a, b in zip(per["A"], per["B"], strict=True)]
    print(f"A = {args.base}, B = working tree; {time.strftime('%Y-%m-%d %H:%M %Z')}, {os.cpu_count()} cores")
    for name in ("A", "B"):
        print(f"{name}: event-loop CPU per token, median {statistics.median(per[name]):.3f} ms "
              f"[{' '.join(f'{x:.3f}' for x in per[name])}]")
    print(f"B/A per round: median {statistics.median(ratios):.3f} [{' '.join(f'{x:.2f}' for x in ratios)}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
