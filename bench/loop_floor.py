"""What the event loop must spend per streamed token on this machine whatever the server does, beside what ours
spends: the floor under the "server overhead < 2 % of a decode step" target.

    .venv/bin/python -m bench.loop_floor [--rounds 8] [--tokens 128]

Two sides, alternating request by request (the machine drifts by tens of percent over minutes):

- **server**: one greedy 128-token stream over HTTP from ``trtserver serve`` (its defaults), read off the raw
  socket; the CPU of its event-loop thread per token (``/proc/PID/task/PID/schedstat``).
- **floor**: the same engine process, driven from this process by a loop set up as the server's is (uvloop, pinned
  beside the engine's last thread) that does the least a streaming server can do per token: wake on the engine's
  step frame, decode it, and write one prebuilt ~250-byte SSE event to a client on a loopback TCP connection.
  No HTTP parsing, detokenizing, stop strings, chunk building or JSON; only the final delta goes on to the
  request's generator, so that it ends.

It prints each side's loop CPU per token, both against the floor side's time per token (a decode step with the
least possible server), and server / floor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

from bench import peers
from bench.overhead import http_stream, loop_cpu_ns, median_gap
from bench.prompts import SHORT

DEFAULT_ENGINE = peers.ROOT / "engines" / "SmolLM2-135M-Instruct"
EVENT = (b'data: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion","created":1764520000,'
         b'"model":"SmolLM2-135M-Instruct","choices":[{"index":0,"text":" word","logprobs":null,'
         b'"finish_reason":null}],"usage":null}\n\n')
READER = ("import socket, sys\n"
          "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
          "while s.recv(65536): pass\n")


class _Accept(asyncio.Protocol):
    def __init__(self, accepted: asyncio.Future[asyncio.Transport]) -> None:
        self.accepted = accepted

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self.accepted.done():
            self.accepted.set_result(cast(asyncio.Transport, transport))  # uvloop's are not subclasses


class Floor:
    """The engine process with its step frames answered by one prebuilt event per token."""

    def __init__(self, engine: Any, client: asyncio.Transport) -> None:
        from trtserver.engine.torch.transport import messages as ipc

        self.engine = engine
        self.times: list[float] = []
        runner = engine.runner

        def on_step(payload: memoryview) -> None:
            outputs, failed, runner.stats = ipc.decode_step(payload)
            for out in outputs:
                for _ in out.token_ids:
                    client.write(EVENT)
                    self.times.append(time.perf_counter())
            if failed or any(out.finish_reason is not None for out in outputs):
                runner._dispatch(outputs, failed)

        runner._on_step = on_step

    async def stream(self, prompt: list[int], tokens: int, rid: str) -> list[float]:
        from trtserver.engine.base import GenerationRequest, SamplingParams

        self.times = []
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        async for _ in self.engine.generate(GenerationRequest(rid, prompt, params)):
            pass
        return self.times


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from trtserver.engine.torch.engine import TorchEngine
    from trtserver.lifecycle import pin_event_loop

    loop = asyncio.get_running_loop()
    server = peers.ours(args.engine_dir.resolve(), peers.free_port())
    rows: list[dict[str, float]] = []
    with server:
        server.start(timeout_s=180)
        assert server.proc is not None
        server_pid, own_pid = server.proc.pid, os.getpid()
        engine = TorchEngine.from_dir(args.engine_dir, engine_process=True)
        await engine.start()
        if engine.runner.threads_bound:
            pin_event_loop(loop)  # as `trtserver serve` does once its engine has started
        accepted: asyncio.Future[asyncio.Transport] = loop.create_future()
        listener = await loop.create_server(lambda: _Accept(accepted), "127.0.0.1", 0)
        reader = subprocess.Popen([sys.executable, "-c", READER, str(listener.sockets[0].getsockname()[1])])
        try:
            floor = Floor(engine, await asyncio.wait_for(accepted, 30))
            prompt = engine.tokenizer.encode(SHORT)
            await http_stream(server.port, args.tokens, args.timeout)  # warm-ups, not counted
            await floor.stream(prompt, args.tokens, "warm-up")
            for r in range(args.rounds):
                row: dict[str, float] = {}
                for side in ("server", "floor") if r % 2 == 0 else ("floor", "server"):
                    pid = server_pid if side == "server" else own_pid
                    cpu0 = loop_cpu_ns(pid)
                    if side == "server":
                        times = await http_stream(server.port, args.tokens, args.timeout)
                    else:
                        times = await floor.stream(prompt, args.tokens, f"round-{r}")
                    row[f"{side}_cpu_ms"] = (loop_cpu_ns(pid) - cpu0) / 1e6 / args.tokens
                    row[f"{side}_gap_ms"] = median_gap(times) * 1e3
                rows.append(row)
                print(f"[floor] round {r + 1}/{args.rounds}: loop CPU per token: server {row['server_cpu_ms']:.3f} ms, "
                      f"floor {row['floor_cpu_ms']:.3f} ms; time per token {row['server_gap_ms']:.2f} / "
                      f"{row['floor_gap_ms']:.2f} ms", flush=True)
        finally:
            listener.close()
            reader.kill()
            reader.wait()
            await engine.shutdown()

    def med(key: str) -> float:
        return statistics.median(row[key] for row in rows)

    step = med("floor_gap_ms")
    return {"rounds": len(rows), "tokens": args.tokens, "step_ms": step, "server_gap_ms": med("server_gap_ms"),
            "server_cpu_ms": med("server_cpu_ms"), "floor_cpu_ms": med("floor_cpu_ms"),
            "server_pct": 100 * med("server_cpu_ms") / step, "floor_pct": 100 * med("floor_cpu_ms") / step,
            "server_over_floor": statistics.median(row["server_cpu_ms"] / row["floor_cpu_ms"] for row in rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.loop_floor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", type=Path, default=DEFAULT_ENGINE)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    ap.add_argument("--json", action="store_true", help="print one RESULT line of JSON")
    args = ap.parse_args(argv)
    import uvloop

    result = uvloop.run(measure(args))
    if args.json:
        print("RESULT " + json.dumps(result), flush=True)
    else:
        print(f"loop CPU per streamed token, median of {result['rounds']} paired rounds, against a step of "
              f"{result['step_ms']:.2f} ms (the floor side's time per token):\n"
              f"  floor (wake, frame, one prebuilt event to a loopback TCP client): {result['floor_cpu_ms']:.3f} ms = "
              f"{result['floor_pct']:.1f} %\n"
              f"  trtserver serve (HTTP, detokenize, SSE):                         {result['server_cpu_ms']:.3f} ms = "
              f"{result['server_pct']:.1f} %\n"
              f"  server / floor, per round: {result['server_over_floor']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
