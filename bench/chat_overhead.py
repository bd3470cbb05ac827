"""What ``/v1/chat/completions`` adds per streamed token over ``/v1/completions`` on the same prompt tokens,
at 1 and 16 concurrent streams, in paired rounds of one run.

Every request gets its own numbered user message (so neither API reuses the other's prefix cache); the
completions request is sent the token ids ``/tokenize`` gives for its messages, so both APIs generate
from prompts of the same tokens through the same template. A round runs, for each concurrency, both
APIs back to back, the order alternating from round to round. Per API and round: the server's CPU
seconds per streamed token (its worker processes included), the share of them spent in the API process
(HTTP, the serving core and each API's shaper: the engine process runs in a child), and the median gap
between a stream's content chunks (one decode step).
Both APIs hand the engine the same token ids with the same sampling, so what chat adds is spent in the
API process; the engine's CPU, tens of times larger, varies from round to round by more than the whole
API process costs. Chat's cost is therefore given twice, each as a paired difference in percent of
completions' whole CPU per token: the API process's difference (the figure the target is about) and the
whole tree's (noisier); the table shows the median over rounds and the spread of the rounds.

    .venv/bin/python -m bench.chat_overhead [--tokens 32] [--max-minutes 3] [--serve-args "--threads 1"]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.peers import cpu_seconds, free_port, process_cpu_seconds, stop_process

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "Tell me a long story about a lighthouse keeper and the sea."
CONCURRENCY = (1, 16)
APIS = ("completions", "chat")


@dataclass
class Side:
    """One API's share of one round at one concurrency."""

    tokens: int
    cpu_s: float
    api_cpu_s: float  # the API process alone, all its threads, without the engine process
    gaps: list[float]

    @property
    def cpu_ms_per_token(self) -> float:
        return 1000 * self.cpu_s / self.tokens

    @property
    def api_us_per_token(self) -> float:
        return 1e6 * self.api_cpu_s / self.tokens

    @property
    def step_ms(self) -> float:
        return 1000 * statistics.median(self.gaps)


@dataclass
class Prompts:
    """Numbered chat messages and the token ids the server's template makes of them, one pair per request."""

    base_url: str
    model: str
    counter: itertools.count[int] = field(default_factory=itertools.count)

    async def next(self, http: aiohttp.ClientSession) -> tuple[list[dict[str, str]], list[int]]:
        messages = [{"role": "user", "content": f"[request {next(self.counter):06d}] {QUESTION}"}]
        async with http.post(f"{self.base_url}/tokenize", json={"model": self.model, "messages": messages}) as r:
            body = await r.json()
        return messages, list(body["tokens"])


async def stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, list[float]]:
    """One streamed request: (completion tokens from the usage chunk, gaps between content chunks)."""
    times: list[float] = []
    tokens = 0
    async with http.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            message = json.loads(payload)
            if message.get("usage"):
                tokens = int(message["usage"]["completion_tokens"])
            for choice in message.get("choices") or ():
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    times.append(time.perf_counter())
    return tokens, [b - a for a, b in itertools.pairwise(times)]


async def run_side(http: aiohttp.ClientSession, api: str, prompts: Prompts, streams: int, tokens: int,
                   pid: int) -> Side:
    common = {"model": prompts.model, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
              "stream": True, "stream_options": {"include_usage": True}}
    bodies = []
    for _ in range(streams):  # prepared before the clock starts
        messages, ids = await prompts.next(http)
        bodies.append({**common, "messages": messages} if api == "chat" else {**common, "prompt": ids})
    url = f"{prompts.base_url}/v1/{'chat/completions' if api == 'chat' else 'completions'}"
    cpu0, api0 = cpu_seconds(pid), process_cpu_seconds(pid)
    results = await asyncio.gather(*(stream(http, url, body) for body in bodies))
    cpu, api_cpu = cpu_seconds(pid) - cpu0, process_cpu_seconds(pid) - api0
    generated = sum(n for n, _ in results)
    if generated != streams * tokens:
        raise RuntimeError(f"{api}: {generated} tokens streamed, expected {streams * tokens}")
    return Side(generated, cpu, api_cpu, [gap for _, gaps in results for gap in gaps])


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):+6.1f}% [{min(values):+.1f}, {max(values):+.1f}]"


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine-dir", default=str(ROOT / "engines" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--tokens", type=int, default=32, help="tokens per stream")
    ap.add_argument("--max-minutes", type=float, default=3.0, help="no round starts after this")
    ap.add_argument("--max-rounds", type=int, default=20)
    ap.add_argument("--serve-args", default="", help="extra flags for `trtserver serve`")
    args = ap.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "trtserver.cli", "serve", args.engine_dir, "--engine", "torch", "--port",
           str(port), "--log-format", "console", *shlex.split(args.serve_args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        await _wait_ready(base, proc, 300)
        start = time.monotonic()
        deadline = start + 60 * args.max_minutes
        print(f"load average at start: {os.getloadavg()[0]:.2f}; {args.tokens} tokens per stream", flush=True)
        prompts = Prompts(base, Path(args.engine_dir).name)
        sides: dict[tuple[int, str], list[Side]] = {(s, a): [] for s in CONCURRENCY for a in APIS}
        connector = aiohttp.TCPConnector(limit=max(CONCURRENCY) + 4)
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=600)) as http:
            for api in APIS:  # warm-up, not counted
                await run_side(http, api, prompts, 2, 4, proc.pid)
            for round_no in range(args.max_rounds):
                if round_no > 0 and time.monotonic() > deadline:
                    break
                order = APIS if round_no % 2 == 0 else APIS[::-1]
                for streams in CONCURRENCY:
                    for api in order:
                        sides[(streams, api)].append(await run_side(http, api, prompts, streams, args.tokens,
                                                                    proc.pid))
                print(f"round {round_no + 1} done at {time.monotonic() - start:.0f} s, load average "
                      f"{os.getloadavg()[0]:.2f}", flush=True)
        print()
        print(f"{'streams':>7} {'rounds':>6} {'compl. cpu ms/tok':>17} {'API us/tok compl.':>17} "
              f"{'API us/tok chat':>15} {'chat +API cpu/tok, median [min, max]':>38} "
              f"{'chat +cpu/tok (tree)':>30} {'compl. step ms':>14} {'chat +step':>24}")
        for streams in CONCURRENCY:
            comp, chat = sides[(streams, "completions")], sides[(streams, "chat")]
            pairs = list(zip(comp, chat, strict=True))
            api = [100 * (b.api_cpu_s / b.tokens - a.api_cpu_s / a.tokens) / (a.cpu_s / a.tokens) for a, b in pairs]
            cpu = [100 * (b.cpu_ms_per_token / a.cpu_ms_per_token - 1) for a, b in pairs]
            step = [100 * (b.step_ms / a.step_ms - 1) for a, b in pairs]
            print(f"{streams:7d} {len(comp):6d} {statistics.median(s.cpu_ms_per_token for s in comp):17.2f} "
                  f"{statistics.median(s.api_us_per_token for s in comp):17.0f} "
                  f"{statistics.median(s.api_us_per_token for s in chat):15.0f} {spread(api):>38} "
                  f"{spread(cpu):>30} {statistics.median(s.step_ms for s in comp):14.2f} {spread(step):>24}")
        print(f"load average at end: {os.getloadavg()[0]:.2f}")
    finally:
        stop_process(proc)



async def _wait_ready(base: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Until ``/health`` answers 200; the server exiting first is an error."""
    deadline = time.perf_counter() + timeout
    async with aiohttp.ClientSession() as http:
        while time.perf_counter() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                async with http.get(f"{base}/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise TimeoutError("server not ready")


if __name__ == "__main__":
    asyncio.run(main())

