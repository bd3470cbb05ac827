"""Soak: many concurrent clients for a bounded time against one real server, on loopback.

    .venv/bin/python -m bench.soak                      # 60 s, 64 clients
    .venv/bin/python -m bench.soak --seconds 20 --clients 16

Every client loops until the deadline over four kinds of request (client i starts at kind i % 4):

* ``stream``     streaming, ``stream_options.include_usage``; must end with ``data: [DONE]`` and its
                 usage must match the tokens asked for (``ignore_eos``)
* ``n2``         non-streaming, ``n=2``; two choices
* ``logprobs``   non-streaming, ``logprobs=2``; one logprob per generated token
* ``disconnect`` streaming, long; the client reads two chunks and drops the connection (deliberate)

Beside them, ``--abusers`` clients (default 4) loop over careless and hostile requests, each bounded
in time: JSON nested 5,000 deep, a gzip header on a plain body, a non-ASCII ``X-Request-Id``, a bad
chunk size on a raw socket, a request head sent byte by byte (the server times it out), a body cut
off mid-way, a slow reader of a stream, and a guided regex that takes seconds to compile (a new one
each time, so no cache serves it). Each must get its 4xx JSON envelope (the slow reader its whole
stream, the guide its constrained text or the time-out's 400); any other answer counts as an error.

Checks (exit status 1 if any fails): zero errors (any non-200, or a transport error other than our
deliberate disconnects, or a malformed answer), every completed stream ends with ``[DONE]``,
server RSS growth < 5 % between the end of the warm-up and the end, and ``trtserver_running_sequences``
(and the queue and KV slots) back to 0 shortly after the load stops. The warm-up (a quarter of the
run) must outlast the load's first allocations: for the RSS check, run a minute or more.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.abuse import ABUSE_KINDS, BODY_TIMEOUT_S, HEAD_TIMEOUT_S, Malformed, abuse
from bench.peers import stop_process

REPO = Path(__file__).resolve().parent.parent
ENGINE_DIR = REPO / "engines" / "SmolLM2-135M-Instruct"
KINDS = ("stream", "n2", "logprobs", "disconnect")
PROMPTS = ("Write a short note about rivers.", "List three colours:", "The capital of France is",
           "def fibonacci(n):", "Once upon a time, in a small village,", "Q: What is 7 times 6?\nA:")


# --- a server subprocess --------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    def __init__(self, engine_dir: Path, flags: list[str], log_name: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"trtserver-{log_name}-{self.port}.log"
        self._log = open(self.log_path, "wb")
        self.command = [sys.executable, "-m", "trtserver.cli", "serve", str(engine_dir), "--engine", "torch",
                        "--port", str(self.port), *flags]
        # a small guide cache, so that its bound (not the default 256 MiB) is what the RSS check holds the
        # slow-guide abusers' ever new guides to
        env = {**os.environ, "TRTSERVER_GUIDED_CACHE_MB": os.environ.get("TRTSERVER_GUIDED_CACHE_MB", "8")}
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, env=env)

    async def wait_ready(self, timeout: float = 180.0) -> float:
        t0 = time.monotonic()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            while time.monotonic() - t0 < timeout:
                if self.process.poll() is not None:
                    raise RuntimeError(f"server exited with {self.process.returncode}; see {self.log_path}")
                try:
                    async with http.get(f"{self.base}/health") as response:
                        if response.status == 200:
                            return time.monotonic() - t0
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.1)
        raise TimeoutError(f"server not healthy after {timeout} s; see {self.log_path}")

    def rss_mb(self) -> float:
        text = Path(f"/proc/{self.process.pid}/status").read_text()
        match = re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE)
        return int(match.group(1)) / 1024 if match else float("nan")

    def stop(self) -> int | None:
        stop_process(self.process, timeout_s=40)
        self._log.close()
        return self.process.returncode


async def scrape(http: aiohttp.ClientSession, base: str) -> dict[str, float]:
    """The unlabelled gauges and counters of /metrics."""
    async with http.get(f"{base}/metrics") as response:
        text = await response.text()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def wait_drained(base: str, timeout: float) -> tuple[float, dict[str, float]]:
    """Seconds until running, waiting and KV slots all read 0 (or the last reading at ``timeout``)."""
    t0 = time.monotonic()
    names = ("trtserver_running_sequences", "trtserver_queue_depth", "trtserver_kv_slots_used")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while True:
            values = await scrape(http, base)
            if all(values.get(name) == 0 for name in names):
                return time.monotonic() - t0, values
            if time.monotonic() - t0 > timeout:
                return float("inf"), values
            await asyncio.sleep(0.1)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


# --- the clients ------------------------------------------------------------------------------------


@dataclass
class Tally:
    done: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    error_samples: list[str] = field(default_factory=list)
    latency: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    tokens: int = 0
    streams_completed: int = 0
    streams_with_done: int = 0
    abused: collections.Counter[str] = field(default_factory=collections.Counter)

    def error(self, kind: str, what: str) -> None:
        self.errors[kind] += 1
        if len(self.error_samples) < 10:
            self.error_samples.append(f"{kind}: {what[:300]}")


async def sse_events(response: aiohttp.ClientResponse) -> collections.abc.AsyncIterator[str]:
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            yield line[len("data: "):]


async def run_stream(http: aiohttp.ClientSession, base: str, prompt: str, tally: Tally) -> None:
    tokens = 16
    body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.post(f"{base}/v1/completions", json=body) as response:
        if response.status != 200:
            raise Malformed(f"HTTP {response.status}: {(await response.text())[:200]}")
        events = [event async for event in sse_events(response)]
    tally.streams_completed += 1
    if not events or events[-1] != "[DONE]":
        raise Malformed(f"stream did not end with [DONE]: {events[-2:]}")
    tally.streams_with_done += 1
    chunks = [json.loads(event) for event in events[:-1]]
    if any("error" in chunk for chunk in chunks):
        raise Malformed(f"error chunk in stream: {chunks}")
    if chunks[-1]["usage"]["completion_tokens"] != tokens:
        raise Malformed(f"usage {chunks[-1]['usage']} != {tokens} tokens")
    tally.tokens += tokens


async def run_json(http: aiohttp.ClientSession, base: str, body: dict[str, object]) -> dict[str, object]:
    async with http.post(f"{base}/v1/completions", json=body) as response:
        if response.status != 200:
            raise Malformed(f"HTTP {response.status}: {(await response.text())[:200]}")
        return await response.json()  # type: ignore[no-any-return]


async def run_n2(http: aiohttp.ClientSession, base: str, prompt: str, tally: Tally) -> None:
    result = await run_json(http, base, {"prompt": prompt, "max_tokens": 12, "n": 2, "temperature": 0.8,
                                            "ignore_eos": True})
    choices = result["choices"]
    if not isinstance(choices, list) or sorted(c["index"] for c in choices) != [0, 1]:
        raise Malformed(f"n=2 answer: {result}")
    tally.tokens += result["usage"]["completion_tokens"]  # type: ignore[index]


async def run_logprobs(http: aiohttp.ClientSession, base: str, prompt: str, tally: Tally) -> None:
    result = await run_json(http, base, {"prompt": prompt, "max_tokens": 12, "logprobs": 2, "ignore_eos": True})
    logprobs = result["choices"][0]["logprobs"]  # type: ignore[index]
    if len(logprobs["tokens"]) != 12 or len(logprobs["top_logprobs"]) != 12:
        raise Malformed(f"logprobs answer: {logprobs}")
    tally.tokens += 12


async def run_disconnect(http: aiohttp.ClientSession, base: str, prompt: str, tally: Tally) -> None:
    body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True}
    response = await http.post(f"{base}/v1/completions", json=body)
    try:
        if response.status != 200:
            raise Malformed(f"HTTP {response.status}: {(await response.text())[:200]}")
        seen = 0
        async for _ in sse_events(response):
            seen += 1
            if seen == 2:
                break
        if seen < 2:
            raise Malformed("stream ended before two chunks")
    finally:
        response.close()  # drop the connection mid-stream (deliberately)


RUNNERS = {"stream": run_stream, "n2": run_n2, "logprobs": run_logprobs, "disconnect": run_disconnect}


async def abuser(index: int, base: str, port: int, deadline: float, tally: Tally) -> None:
    step = index
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as http:
        while time.monotonic() < deadline:
            kind = ABUSE_KINDS[step % len(ABUSE_KINDS)]
            step += 1
            try:
                await asyncio.wait_for(abuse(kind, http, base, port), 60)
            except Malformed as exc:
                tally.error(f"abuse:{kind}", str(exc))
            except (OSError, aiohttp.ClientError, TimeoutError) as exc:
                tally.error(f"abuse:{kind}", f"{type(exc).__name__}: {exc}")
            else:
                tally.abused[kind] += 1


async def client(index: int, base: str, deadline: float, tally: Tally, request_timeout: float) -> None:
    step = index
    # one connection per client (as separate users would have); a disconnect forces a fresh one
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=request_timeout)) as http:
        while time.monotonic() < deadline:
            kind = KINDS[step % len(KINDS)]
            prompt = PROMPTS[step % len(PROMPTS)]
            step += 1
            t0 = time.monotonic()
            try:
                await RUNNERS[kind](http, base, prompt, tally)
            except Malformed as exc:
                tally.error(kind, str(exc))
            except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, KeyError, TypeError) as exc:
                tally.error(kind, f"{type(exc).__name__}: {exc}")
            else:
                tally.done[kind] += 1
                tally.latency[kind].append(time.monotonic() - t0)


# --- the run ----------------------------------------------------------------------------------------


async def prime_kv_cache(base: str, slots: int, context: int) -> float:
    """Fill every KV slot to the full context once. The cache is allocated as untouched zero pages,
    so its RSS grows as positions are first written; priming makes that growth happen before the
    measurement, so what is left is growth the load itself causes."""
    body = {"prompt": "Once upon a time", "max_tokens": context - 8, "ignore_eos": True, "temperature": 0}
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        guided = {"prompt": "Name:", "max_tokens": 4, "guided_regex": "[a-z ]{1,999}"}
        async with http.post(f"{base}/v1/completions", json=guided) as response:
            await response.read()  # loads the guide compiler in both processes, as the first guided request does

        async def one() -> None:
            async with http.post(f"{base}/v1/completions", json=body) as response:
                response.raise_for_status()
                await response.read()

        for _ in range(2):  # the second wave reaches the slots that only keep cached prefixes
            await asyncio.gather(*(one() for _ in range(slots)))
    return time.monotonic() - t0


async def soak(args: argparse.Namespace) -> int:
    flags = ["--max-model-len", "256", "--max-batch-size", str(args.max_batch_size),
             "--header-timeout-s", str(HEAD_TIMEOUT_S), "--body-timeout-s", str(BODY_TIMEOUT_S), *args.server_flag]
    server = ServerProcess(Path(args.engine_dir), flags, "soak")
    try:
        startup = await server.wait_ready()
        print(f"server ready in {startup:.1f} s: {' '.join(server.command[1:])}", flush=True)
        rss_ready = server.rss_mb()
        primed = await prime_kv_cache(server.base, args.max_batch_size, 256)
        print(f"KV cache primed in {primed:.1f} s: RSS {rss_ready:.0f} -> {server.rss_mb():.0f} MiB", flush=True)
        tally = Tally()
        start = time.monotonic()
        deadline = start + args.seconds
        warm_end = start + args.warmup
        rss: list[tuple[float, float]] = [(0.0, server.rss_mb())]
        tasks = [asyncio.create_task(client(i, server.base, deadline, tally, args.request_timeout))
                 for i in range(args.clients)]
        tasks += [asyncio.create_task(abuser(i, server.base, server.port, deadline, tally))
                  for i in range(args.abusers)]
        rss_warm = float("nan")
        while not all(task.done() for task in tasks):
            await asyncio.sleep(1.0)
            now = time.monotonic()
            rss.append((now - start, server.rss_mb()))
            if rss_warm != rss_warm and now >= warm_end:  # nan until the warm-up ends
                rss_warm = rss[-1][1]
            if now > deadline + args.request_timeout + 30:
                for task in tasks:
                    task.cancel()
                tally.error("harness", "clients still running long after the deadline")
                break
        await asyncio.gather(*tasks, return_exceptions=True)
        wall = time.monotonic() - start
        rss_end = server.rss_mb()
        drained_s, gauges = await wait_drained(server.base, timeout=args.drain_timeout)
        async with aiohttp.ClientSession() as http:
            counters = await scrape(http, server.base)
        code = server.stop()
    finally:
        server.stop()

    growth = (rss_end - rss_warm) / rss_warm * 100
    completed = sum(tally.done.values())
    errors = sum(tally.errors.values())
    print()
    print(f"soak: {args.clients} clients, {args.seconds:.0f} s (+{wall - args.seconds:.1f} s to finish the last "
          f"requests), warm-up {args.warmup:.0f} s, --max-batch-size {args.max_batch_size}, load avg "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print()
    print(f"| {'kind':10} | {'ok':>6} | {'errors':>6} | {'p50 s':>7} | {'p95 s':>7} | {'max s':>7} |")
    print(f"|{'-' * 12}|{'-' * 8}|{'-' * 8}|{'-' * 9}|{'-' * 9}|{'-' * 9}|")
    for kind in KINDS:
        lat = tally.latency[kind]
        print(f"| {kind:10} | {tally.done[kind]:6d} | {tally.errors[kind]:6d} | {pct(lat, 50):7.2f} | "
              f"{pct(lat, 95):7.2f} | {max(lat, default=float('nan')):7.2f} |")
    print(f"| {'all':10} | {completed:6d} | {errors:6d} | {'':7} | {'':7} | {'':7} |")
    abuse_errors = sum(n for kind, n in tally.errors.items() if kind.startswith("abuse:"))
    print(f"abusers: {args.abusers}; answered as expected {dict(tally.abused)}; otherwise {abuse_errors}")
    print()
    print(f"requests/s {completed / wall:.1f}; tokens of checked answers/s {tally.tokens / wall:.1f}")
    print(f"streams completed {tally.streams_completed}, ending with [DONE] {tally.streams_with_done}")
    print(f"server RSS MiB: start {rss[0][1]:.0f}, warm-up end {rss_warm:.0f}, end {rss_end:.0f} "
          f"(growth {growth:+.2f} %), max {max(r for _, r in rss):.0f}")
    every = max(1, len(rss) // 12)
    print("server RSS MiB over time: " + ", ".join(f"{t:.0f}s {r:.0f}" for t, r in rss[::every]))
    print(f"after the load: running/queue/KV slots "
          f"{gauges.get('trtserver_running_sequences')}/{gauges.get('trtserver_queue_depth')}/"
          f"{gauges.get('trtserver_kv_slots_used')}, back to 0 in {drained_s:.2f} s")
    statuses = {k: v for k, v in counters.items() if k.startswith("trtserver_requests_total")}
    print(f"server-side request counts: {statuses}")
    print(f"server exit code on SIGTERM: {code}")
    for sample in tally.error_samples:
        print("  error:", sample)

    checks = {
        "zero errors": errors == 0,
        "every completed stream ends with [DONE]": tally.streams_completed == tally.streams_with_done > 0,
        "every kind completed": all(tally.done[kind] > 0 for kind in KINDS),
        "every abuse kind answered as expected": args.abusers == 0 or set(tally.abused) == set(ABUSE_KINDS),
        "RSS growth < 5 % after warm-up": growth < 5.0,
        "running sequences back to 0": drained_s <= args.drain_timeout,
        "clean exit on SIGTERM": code == 0,
    }
    print()
    for name, passed in checks.items():
        print(f"  {'PASS' if passed else 'FAIL'}  {name}")
    return 0 if all(checks.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--warmup", type=float, default=None, help="seconds (default: a quarter of --seconds)")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--abusers", type=int, default=4, help="clients sending careless and hostile requests")
    parser.add_argument("--request-timeout", type=float, default=180.0)
    parser.add_argument("--drain-timeout", type=float, default=5.0,
                        help="how long running sequences may take to reach 0 after the load")
    parser.add_argument("--engine-dir", default=str(ENGINE_DIR))
    parser.add_argument("--server-flag", action="append", default=[], help="extra `trtserver serve` flag (repeat)")
    args = parser.parse_args(argv)
    if args.warmup is None:
        args.warmup = args.seconds / 4
    return asyncio.run(soak(args))


if __name__ == "__main__":
    sys.exit(main())
