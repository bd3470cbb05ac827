"""One asyncio SSE client for every server the harness drives (ours and the peer), so both are measured alike.

A stream's tokens are counted from the ``usage`` chunk when the server sends one (``stream_options.include_usage``),
else by counting content chunks (one token per chunk on llama-cpp-python's server); ``StreamResult.counted_by``
says which. Every request has a time limit.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class StreamResult:
    ok: bool
    tokens: int = 0
    chunks: int = 0
    ttft_s: float = 0.0  # request sent -> first content chunk
    latency_s: float = 0.0  # request sent -> stream closed
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk, from request start
    counted_by: str = "chunks"  # "usage" or "chunks"
    text: str = ""
    finish_reason: str | None = None
    error: str = ""

    @property
    def decode_tps(self) -> float:
        """Per-stream decode rate: tokens after the first over the time after the first."""
        if self.tokens < 2 or self.latency_s <= self.ttft_s:
            return 0.0
        return (self.tokens - 1) / (self.latency_s - self.ttft_s)

    @property
    def inter_chunk_s(self) -> float:
        """Median gap between content chunks (the streamed time per token at batch 1)."""
        gaps = [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]
        return statistics.median(gaps) if gaps else 0.0


@dataclass
class LoadResult:
    streams: int
    wall_s: float
    results: list[StreamResult]

    @property
    def ok(self) -> list[StreamResult]:
        return [r for r in self.results if r.ok]

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.ok)

    @property
    def agg_tps(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def pct(self, attr: str, q: float) -> float:
        values = sorted(getattr(r, attr) for r in self.ok)
        if not values:
            return float("nan")
        # nearest-rank percentile: with few samples p99 is the maximum
        k = min(len(values) - 1, max(0, int(round(q / 100 * len(values) + 0.5)) - 1))
        return float(values[k])

    @property
    def per_stream_tps(self) -> float:
        values = [r.decode_tps for r in self.ok]
        return statistics.median(values) if values else 0.0

    @property
    def counted_by(self) -> str:
        return ",".join(sorted({r.counted_by for r in self.ok})) or "-"

    @property
    def failures(self) -> int:
        return len(self.results) - len(self.ok)


STALE_TRIES = 3


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout_s: float) -> aiohttp.ClientResponse:
    """POST ``body``; again when the pooled connection it went out on turns out closed before any answer
    (llama-server closes a connection after a streamed response without saying so, and the pool may hand it
    out before its close is seen): such a request never reached the server."""
    for attempt in range(STALE_TRIES):
        try:
            return await http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s))
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
            if attempt == STALE_TRIES - 1:
                raise
    raise AssertionError("unreachable")


async def stream_completion(http: aiohttp.ClientSession, base_url: str, model: str, prompt: str, max_tokens: int,
                            *, extra: dict[str, Any] | None = None, timeout_s: float = 300.0) -> StreamResult:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": True}
    body.update(extra or {})
    res = StreamResult(ok=False)
    usage_tokens: int | None = None
    t0 = time.perf_counter()
    try:
        async with await post(http, f"{base_url}/v1/completions", body, timeout_s) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            buf = b""
            done = False
            async for data in resp.content.iter_any():
                buf += data
                while b"\n\n" in buf and not done:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            done = True
                            break
                        msg = json.loads(payload)
                        if msg.get("usage"):
                            usage_tokens = int(msg["usage"].get("completion_tokens", 0))
                        for choice in msg.get("choices") or ():
                            piece = choice.get("text") or ""
                            if choice.get("finish_reason"):
                                res.finish_reason = choice["finish_reason"]
                            if piece:
                                now = time.perf_counter() - t0
                                if not res.chunk_times:
                                    res.ttft_s = now
                                res.chunk_times.append(now)
                                res.chunks += 1
                                res.text += piece
                if done:
                    break
        res.latency_s = time.perf_counter() - t0
        if usage_tokens is not None:
            res.tokens, res.counted_by = usage_tokens, "usage"
        else:
            res.tokens, res.counted_by = res.chunks, "chunks"
        res.ok = res.tokens > 0
        if not res.ok:
            res.error = "no tokens"
    except (asyncio.TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def completion_usage(base_url: str, model: str, prompt: str, max_tokens: int,
                           extra: dict[str, Any] | None = None, timeout_s: float = 300.0) -> tuple[int, str, str]:
    """A non-streamed request: (completion_tokens from usage, finish_reason, text)."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    body.update(extra or {})
    async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http,
                http.post(f"{base_url}/v1/completions", json=body) as resp):
        msg = await resp.json()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {str(msg)[:300]}")
    choice = msg["choices"][0]
    return int(msg["usage"]["completion_tokens"]), str(choice.get("finish_reason")), str(choice.get("text"))


_counter = itertools.count()


def with_question(prompt: str) -> str:
    """The prompt, then a short tail of its own: requests share the prompt as a prefix."""
    return f"{prompt}Question {next(_counter):05d}: what happens next?\n\nAnswer:"


def unique(prompt: str) -> str:
    """The prompt behind a per-request tag, so no server can reuse a previous request's KV cache for it
    (llama-cpp-python keeps the last prompt's cache and reuses the longest common prefix)."""
    return f"[request {next(_counter):05d}] {prompt}"


async def run_load(base_url: str, model: str, prompt: str, max_tokens: int, streams: int, per_stream: int,
                   *, extra: dict[str, Any] | None = None, timeout_s: float = 600.0,
                   fresh_prompts: bool = True, shared_prefix: bool = False) -> LoadResult:
    """``streams`` closed-loop workers, each sending ``per_stream`` requests back to back (bounded).
    ``shared_prefix``: every request is ``prompt`` plus a tail of its own (``with_question``)."""
    connector = aiohttp.TCPConnector(limit=streams + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:

        async def worker() -> list[StreamResult]:
            out = []
            for _ in range(per_stream):
                text = with_question(prompt) if shared_prefix else unique(prompt) if fresh_prompts else prompt
                out.append(await stream_completion(http, base_url, model, text, max_tokens, extra=extra,
                                                   timeout_s=timeout_s))
            return out

        t0 = time.perf_counter()
        groups = await asyncio.gather(*(worker() for _ in range(streams)))
        wall = time.perf_counter() - t0
    return LoadResult(streams=streams, wall_s=wall, results=[r for g in groups for r in g])
