"""Server overhead per streamed token, head to head: the same request streamed over HTTP by ``trtserver serve``
and run through ``TorchEngine.generate`` with no server at all, alternating request by request.

    .venv/bin/python -m bench.overhead [--rounds 12] [--tokens 128] [--ours-args "..."] [--json]

Both sides run the server's defaults (the model in its own process, the same thread counts); each side's
engine idles while the other runs. A round is one request on each side, in alternating order; its overhead is
the difference of the two median gaps between tokens, divided by the gap without HTTP. This machine drifts by
tens of percent over minutes, so only figures taken seconds apart are compared: the result is the median over
rounds, with its spread. The HTTP client reads the raw socket and only counts ``data:`` events, so that it
costs about what the in-process consumer does. The server's event-loop CPU per token (``schedstat`` of its main
thread) is printed beside it: that is the work's cost in CPU, where the first figure is its cost in time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import peers
from bench.prompts import SHORT

DEFAULT_ENGINE = peers.ROOT / "engines" / "SmolLM2-135M-Instruct"


def median_gap(times: list[float]) -> float:
    return statistics.median(b - a for a, b in zip(times, times[1:], strict=False))


def loop_cpu_ns(pid: int) -> int:
    """CPU time of the process's main thread (our server's event loop), in ns."""
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0])


async def http_stream(port: int, tokens: int, timeout_s: float) -> list[float]:
    """Arrival time of every SSE event that carries a token (``data: {``), read straight off the socket."""
    body = json.dumps({"prompt": SHORT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    times: list[float] = []
    try:
        writer.write(head + body)
        async with asyncio.timeout(timeout_s):
            while True:
                data = await reader.read(65536)
                now = time.perf_counter()
                if not data:
                    break
                times.extend([now] * data.count(b"data: {"))
                if b"data: [DONE]" in data:
                    break
    finally:
        writer.close()
    return times


async def inproc_stream(engine: Any, prompt: list[int], tokens: int, rid: str) -> list[float]:
    from trtserver.engine.base import GenerationRequest, SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    times: list[float] = []
    async for delta in engine.generate(GenerationRequest(rid, prompt, params)):
        times.extend([time.perf_counter()] * len(delta.token_ids))
    return times


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from trtserver.engine.torch.engine import TorchEngine

    options: dict[str, Any] = {"engine_process": True}  # the server's defaults, as in the server
    extra = args.ours_args.split()
    if args.dtype != "auto":
        options["dtype"] = args.dtype
        extra += ["--dtype", args.dtype]
    if args.device != "cpu":
        options["device"] = args.device
    server = peers.ours(args.engine_dir.resolve(), peers.free_port(), device=args.device, extra=extra)
    rows: list[dict[str, float]] = []
    with server:
        server.start(timeout_s=180)
        assert server.proc is not None
        pid = server.proc.pid
        engine = TorchEngine.from_dir(args.engine_dir, **options)
        await engine.start()
        try:
            prompt = engine.tokenizer.encode(SHORT)
            await http_stream(server.port, args.tokens, args.timeout)  # warm-ups, not counted
            await inproc_stream(engine, prompt, args.tokens, "warm-up")
            for r in range(args.rounds):
                row: dict[str, float] = {}
                for side in (("http", "inproc") if r % 2 == 0 else ("inproc", "http")):
                    if side == "http":
                        cpu0 = loop_cpu_ns(pid)
                        times = await http_stream(server.port, args.tokens, args.timeout)
                        row["loop_cpu_ms"] = (loop_cpu_ns(pid) - cpu0) / 1e6 / args.tokens
                    else:
                        times = await inproc_stream(engine, prompt, args.tokens, f"round-{r}")
                    row[side] = median_gap(times) * 1e3
                row["overhead_pct"] = 100 * (row["http"] - row["inproc"]) / row["inproc"]
                rows.append(row)
                print(f"[overhead] round {r + 1}/{args.rounds}: over HTTP {row['http']:.2f} ms per token, "
                      f"without {row['inproc']:.2f} ms: {row['overhead_pct']:+.1f} %; "
                      f"event loop {row['loop_cpu_ms']:.3f} ms CPU per token", flush=True)
        finally:
            await engine.shutdown()

    def med(key: str) -> float:
        return statistics.median(row[key] for row in rows)

    over = [row["overhead_pct"] for row in rows]
    return {"rounds": len(rows), "tokens": args.tokens, "http_ms": med("http"), "inproc_ms": med("inproc"),
            "overhead_pct": statistics.median(over), "overhead_pct_min": min(over), "overhead_pct_max": max(over),
            "loop_cpu_ms": med("loop_cpu_ms"), "loop_cpu_pct": 100 * med("loop_cpu_ms") / med("inproc")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", type=Path, default=DEFAULT_ENGINE)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--ours-args", default="", help="extra flags for `trtserver serve` (space-separated)")
    ap.add_argument("--dtype", default="auto", help="both sides")
    ap.add_argument("--device", default="cpu", help="both sides")
    ap.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    ap.add_argument("--json", action="store_true", help="print one RESULT line of JSON (for the harness)")
    args = ap.parse_args(argv)
    result = asyncio.run(measure(args))
    if args.json:
        print("RESULT " + json.dumps(result), flush=True)
    else:
        print(f"server overhead per streamed token, median of {result['rounds']} paired rounds: "
              f"{result['overhead_pct']:+.1f} % (rounds {result['overhead_pct_min']:+.1f} to "
              f"{result['overhead_pct_max']:+.1f} %); {result['http_ms']:.2f} ms per token over HTTP, "
              f"{result['inproc_ms']:.2f} ms without; event-loop CPU {result['loop_cpu_ms']:.3f} ms per token = "
              f"{result['loop_cpu_pct']:.1f} % of a decode step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
