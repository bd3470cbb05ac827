"""RedisQuotaStore against a real redis-server: the in-memory store's decisions, exact across
stores (replicas), the window's edge, key prefixes, and Redis gone, hung, password, TLS."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs
from trtserver_redis_quota.store import RedisQuotaStore
from trtserver_redis_quota.testing import RedisServer

from trtserver.config import TierLimits
from trtserver.errors import Overloaded
from trtserver.quota import MemoryQuotaStore, QuotaDecision

MakeStore = Callable[..., RedisQuotaStore]


def project() -> str:
    return f"p-{uuid.uuid4().hex[:8]}"


def same(a: QuotaDecision, b: QuotaDecision) -> bool:
    """Equal but for Retry-After, which two clocks read a few milliseconds apart."""
    counts = (a.allowed, a.remaining_requests, a.remaining_tokens)
    close = abs(a.retry_after_s - b.retry_after_s) < 0.5
    return counts == (b.allowed, b.remaining_requests, b.remaining_tokens) and close


@pytest.mark.parametrize("limits", [TierLimits(requests_per_minute=3), TierLimits(tokens_per_minute=50),
                                    TierLimits(requests_per_minute=3, tokens_per_minute=50),
                                    TierLimits(requests_per_minute=0), TierLimits()])
async def test_decisions_and_headers_match_the_memory_store(redis_server: RedisServer, make_store: MakeStore,
                                                            limits: TierLimits) -> None:
    store, memory, name = make_store(redis_server.url), MemoryQuotaStore(), project()
    steps: list[int | None] = [None, 20, None, 0, None, 40, None, None]  # None: a request; a number: its charge
    for step in steps:
        now = time.monotonic()
        if step is None:
            ours, theirs = await store.acquire(name, limits, now), memory.acquire(name, limits, now)
            assert same(ours, theirs), (limits, ours, theirs)
        else:
            await store.add_tokens(name, step, now)
            memory.add_tokens(name, step, now)


async def test_two_stores_on_one_redis_admit_exactly_the_limit(redis_server: RedisServer,
                                                              make_store: MakeStore) -> None:
    replicas, name, limits = [make_store(redis_server.url), make_store(redis_server.url)], project(), TierLimits(
        requests_per_minute=10)
    decisions = await asyncio.gather(*(replicas[i % 2].acquire(name, limits, 0.0) for i in range(30)))
    assert sum(d.allowed for d in decisions) == 10
    refused = [d for d in decisions if not d.allowed]
    assert all(d.remaining_requests == 0 and 59 <= d.retry_after_s <= 60 for d in refused)
    assert sorted(d.remaining_requests or 0 for d in decisions if d.allowed) == list(range(10))
    assert all(d.remaining_requests is not None for d in decisions)


async def test_tokens_charged_on_one_store_count_on_the_other(redis_server: RedisServer,
                                                             make_store: MakeStore) -> None:
    a, b, name, limits = make_store(redis_server.url), make_store(redis_server.url), project(), TierLimits(
        tokens_per_minute=40)
    assert (await a.acquire(name, limits, 0.0)).remaining_tokens == 40
    await a.add_tokens(name, 30, 0.0)
    assert (await b.acquire(name, limits, 0.0)).remaining_tokens == 10
    await b.add_tokens(name, 10, 0.0)
    refused = await a.acquire(name, limits, 0.0)
    assert not refused.allowed and refused.remaining_tokens == 0 and 59 <= refused.retry_after_s <= 60


async def test_entries_older_than_a_minute_leave_the_window(redis_server: RedisServer, make_store: MakeStore) -> None:
    store, name = make_store(redis_server.url), project()
    requests_key, tokens_key, sum_key = store.keys(name)
    seconds, micros = await store.client.time()
    now_us = seconds * 1_000_000 + micros
    # as if charged 61 s and 59.5 s ago, and a request admitted 59.5 s ago
    await store.client.zadd(tokens_key, {"old:25": now_us - 61_000_000, "recent:5": now_us - 59_500_000})
    await store.client.set(sum_key, 30)
    await store.client.zadd(requests_key, {"recent": now_us - 59_500_000})
    decision = await store.acquire(name, TierLimits(requests_per_minute=1, tokens_per_minute=100), 0.0)
    assert not decision.allowed and decision.remaining_tokens == 95  # the old charge is gone; the request is not
    assert 1.0 <= decision.retry_after_s <= 1.5  # the oldest entry leaves in 0.5 s; never less than 1 s
    assert await store.client.get(sum_key) == b"5" and await store.client.zcard(tokens_key) == 1


async def test_retry_after_counts_from_the_oldest_entry_of_either_kind(redis_server: RedisServer,
                                                                       make_store: MakeStore) -> None:
    """A long request's charge can outlive its admission in the window, as in the in-memory store."""
    store, name = make_store(redis_server.url), project()
    requests_key, tokens_key, sum_key = store.keys(name)
    seconds, micros = await store.client.time()
    now_us = seconds * 1_000_000 + micros
    await store.client.zadd(tokens_key, {"a:50": now_us - 50_000_000})
    await store.client.set(sum_key, 50)
    await store.client.zadd(requests_key, {"b": now_us - 30_000_000})
    decision = await store.acquire(name, TierLimits(tokens_per_minute=50), 0.0)
    assert not decision.allowed and 9.5 <= decision.retry_after_s <= 10.5


async def test_key_prefix_keeps_two_deployments_apart(redis_server: RedisServer, make_store: MakeStore) -> None:
    blue, green, name = (make_store(redis_server.url, key_prefix="blue:"),
                         make_store(redis_server.url, key_prefix="green:"), project())
    limits = TierLimits(requests_per_minute=1)
    assert (await blue.acquire(name, limits, 0.0)).allowed and (await green.acquire(name, limits, 0.0)).allowed
    assert not (await blue.acquire(name, limits, 0.0)).allowed
    keys = [key.decode() async for key in blue.client.scan_iter(match=f"*{name}*")]
    assert sorted(keys) == [f"blue:{{{name}}}:requests", f"green:{{{name}}}:requests"]


async def test_redis_stopped_fails_open_then_recovers(tmp_path: Path, make_store: MakeStore) -> None:
    with RedisServer(tmp_path) as server:
        store, name, limits = make_store(server.url, timeout_s=0.5), project(), TierLimits(requests_per_minute=5)
        assert (await store.acquire(name, limits, 0.0)).remaining_requests == 4
        server.stop()
        with capture_logs() as logs:
            started = time.monotonic()
            for _ in range(3):
                assert await store.acquire(name, limits, 0.0) == QuotaDecision(True, None, None)
                await store.add_tokens(name, 7, 0.0)  # dropped, never raised
            assert time.monotonic() - started < 3 * 2 * 0.5 + 1
        assert [entry["event"] for entry in logs] == ["quota_store_unavailable"]  # once a minute, not per call
        assert logs[0]["behaviour"] == "fail_open"
        server.start()  # same port, empty: counting starts again
        with capture_logs() as logs:
            assert (await store.acquire(name, limits, 0.0)).remaining_requests == 4
        assert [entry["event"] for entry in logs] == ["quota_store_recovered"]


async def test_redis_stopped_fails_closed_with_503_then_recovers(tmp_path: Path, make_store: MakeStore) -> None:
    with RedisServer(tmp_path) as server:
        store, name, limits = make_store(server.url, on_unavailable="fail_closed"), project(), TierLimits(
            requests_per_minute=5)
        server.stop()
        with pytest.raises(Overloaded) as refused:
            await store.acquire(name, limits, 0.0)
        assert refused.value.status == 503 and refused.value.headers["Retry-After"] == "1"
        assert refused.value.code == "quota_store_unavailable"
        server.start()
        assert (await store.acquire(name, limits, 0.0)).remaining_requests == 4


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers (a hung Redis)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield int(listener.getsockname()[1])


async def test_a_hung_redis_costs_at_most_the_timeout(silent_port: int, make_store: MakeStore) -> None:
    url, limits = f"redis://127.0.0.1:{silent_port}/0", TierLimits(requests_per_minute=5)
    store = make_store(url, timeout_s=0.2)
    started = time.monotonic()
    assert (await store.acquire(project(), limits, 0.0)).allowed
    assert 0.15 < time.monotonic() - started < 1.0
    started = time.monotonic()  # right after a timeout, requests do not wait for it again
    await store.add_tokens(project(), 3, 0.0)
    assert (await store.acquire(project(), limits, 0.0)).allowed
    assert time.monotonic() - started < 0.1
    closed = make_store(url, timeout_s=0.2, on_unavailable="fail_closed")
    with pytest.raises(Overloaded):
        await asyncio.wait_for(closed.acquire(project(), limits, 0.0), 2.0)


async def test_password_and_tls_in_the_url(tmp_path: Path, tls_files: tuple[Path, Path, Path],
                                           make_store: MakeStore) -> None:
    with RedisServer(tmp_path, password="s3cret", tls=tls_files) as server:
        assert server.url.startswith("rediss://:s3cret@")
        store, name = make_store(server.url), project()
        assert (await store.acquire(name, TierLimits(requests_per_minute=2), 0.0)).remaining_requests == 1
        wrong = make_store(server.url.replace("s3cret", "wrong"), on_unavailable="fail_closed")
        with pytest.raises(Overloaded):
            await wrong.acquire(name, TierLimits(requests_per_minute=2), 0.0)
        plain = aioredis.Redis(host="127.0.0.1", port=server.port, password="s3cret", socket_timeout=1)
        try:  # the port speaks TLS only: a plaintext client gets nowhere
            with pytest.raises((aioredis.ConnectionError, aioredis.TimeoutError, OSError)):
                await plain.ping()
        finally:
            await plain.aclose()
