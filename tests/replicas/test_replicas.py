"""Replicas that share quotas in Redis, behind nginx: exact limits across replicas, tokens charged
however a request ends, Redis gone and back, SSE through the proxy, draining, metrics, fingerprints.

The tests run in file order on one deployment; the last one stops a replica.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from tests.replicas.deployment import Deployment

pytestmark = pytest.mark.replicas

SHORT = {"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 2, "temperature": 0}


def post(base: str, project: str | None = None, **body: object) -> httpx.Response:
    url = f"{base}/v1/completions" + (f"?ai_project_id={project}" if project else "")
    return httpx.post(url, json={**SHORT, **body}, timeout=60)


def events(lines: Iterator[str]) -> Iterator[dict[str, object] | str]:
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            yield data if data == "[DONE]" else json.loads(data)


def token_sum(deployment: Deployment, project: str) -> int:
    client = redis.Redis.from_url(deployment.redis.url, socket_timeout=2)
    try:
        value = client.get(f"{deployment.key_prefix}{{{project}}}:token_sum")
    finally:
        client.close()
    return int(value or 0)


def requests_counted(metrics_text: str) -> int:
    return int(sum(float(m) for m in re.findall(r'^trtserver_requests_total\{[^}]*status="200"[^}]*\} (\S+)$',
                                                 metrics_text, re.MULTILINE)))


def gauge(base: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", httpx.get(f"{base}/metrics", timeout=10).text, re.MULTILINE)
    assert match is not None, f"{name} missing from {base}/metrics"
    return float(match.group(1))


def test_system_fingerprint_is_the_same_on_both_replicas(deployment: Deployment) -> None:
    fingerprints = {post(replica.base).json()["system_fingerprint"] for replica in deployment.replicas}
    assert len(fingerprints) == 1 and next(iter(fingerprints)).startswith("fp_")


def test_requests_per_minute_are_exact_across_replicas(deployment: Deployment) -> None:
    """rpm = 10, 15 requests at once over both replicas: 10 served, 5 refused with 429 + Retry-After."""
    bases = [deployment.replicas[i % 2].base for i in range(15)]
    with ThreadPoolExecutor(max_workers=15) as pool:
        responses = list(pool.map(lambda base: post(base, "rpm10", service_tier="default", max_tokens=1), bases))
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 10 + [429] * 5, statuses
    served = [r for r in responses if r.status_code == 200]
    assert sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in served) == list(range(10))
    for refused in (r for r in responses if r.status_code == 429):
        assert 1 <= int(refused.headers["Retry-After"]) <= 60
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert refused.json()["error"]["type"] == "rate_limit_error"
    assert {deployment.replicas[i % 2].base for i, r in enumerate(responses) if r.status_code == 200} == {
        replica.base for replica in deployment.replicas}  # both replicas served some


def test_tokens_are_charged_across_replicas(deployment: Deployment) -> None:
    first = post(deployment.open_replica.base, "tokens", max_tokens=3)
    assert first.status_code == 200 and first.headers["x-ratelimit-remaining-tokens"] == "1000"
    used = first.json()["usage"]["total_tokens"]
    second = post(deployment.closed_replica.base, "tokens", max_tokens=3)
    assert second.headers["x-ratelimit-remaining-tokens"] == str(1000 - used)
    used += second.json()["usage"]["total_tokens"]
    assert post(deployment.open_replica.base, "tokens").headers["x-ratelimit-remaining-tokens"] == str(1000 - used)


def test_tokens_are_charged_when_the_client_goes_away(deployment: Deployment) -> None:
    with httpx.stream("POST", f"{deployment.open_replica.base}/v1/completions?ai_project_id=gone", timeout=60,
                      json={**SHORT, "max_tokens": 200, "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _, _chunk in zip(range(3), events(lines)):
            pass
    # the client is gone after three chunks; the replica charges what it used once the request ends
    deadline = time.monotonic() + 20
    while (charged := token_sum(deployment, "gone")) == 0:
        assert time.monotonic() < deadline, "no tokens charged for the abandoned stream"
        time.sleep(0.1)
    assert 3 < charged < 200
    other = post(deployment.closed_replica.base, "gone")
    assert other.headers["x-ratelimit-remaining-tokens"] == str(1000 - charged)


def test_streamed_chunks_pass_nginx_one_by_one(deployment: Deployment) -> None:
    arrivals: list[tuple[float, int]] = []  # (time, chunks in that read)
    with httpx.stream("POST", f"{deployment.nginx.base}/v1/completions", timeout=60,
                      json={**SHORT, "max_tokens": 24, "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        body = b""
        for data in response.iter_raw():
            arrivals.append((time.monotonic(), data.count(b"data: ")))
            body += data
    chunks = [e for e in events(iter(body.decode().splitlines())) if e != "[DONE]"]
    assert len(chunks) >= 24
    reads_with_chunks = [t for t, n in arrivals if n]
    # buffered by the proxy, the chunks would come in one read (or a few) at the end
    assert len(reads_with_chunks) >= 12, arrivals
    assert reads_with_chunks[-1] - reads_with_chunks[0] > 0.05


def test_nginx_spreads_requests_and_both_replicas_metrics_are_scraped(deployment: Deployment) -> None:
    before = [requests_counted(httpx.get(f"{r.base}/metrics", timeout=10).text) for r in deployment.replicas]
    for _ in range(4):
        assert post(deployment.nginx.base).status_code == 200
    after = [requests_counted(httpx.get(f"{r.base}/metrics", timeout=10).text) for r in deployment.replicas]
    served = [b - a for a, b in zip(before, after)]
    assert sum(served) == 4 and min(served) >= 1, served


def test_redis_stopped_mid_run_then_back(deployment: Deployment) -> None:
    """fail_open serves uncounted, fail_closed answers 503 + Retry-After; no other 5xx; both count again after."""
    with httpx.stream("POST", f"{deployment.open_replica.base}/v1/completions?ai_project_id=tokens", timeout=60,
                      json={**SHORT, "max_tokens": 30, "ignore_eos": True, "stream": True}) as response:
        lines = response.iter_lines()
        first = next(events(lines))
        assert isinstance(first, dict) and "error" not in first
        deployment.redis.stop()  # mid-stream: its charge at the end cannot be made
        rest = list(events(lines))
    assert rest[-1] == "[DONE]" and all(isinstance(e, dict) and "error" not in e for e in rest[:-1])

    served = post(deployment.open_replica.base, "rpm10", service_tier="default")  # over its quota, yet served
    assert served.status_code == 200 and "x-ratelimit-remaining-requests" not in served.headers
    refused = post(deployment.closed_replica.base, "rpm10", service_tier="default")
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "quota_store_unavailable"
    assert post(deployment.closed_replica.base).status_code == 200  # no quota to check: served

    deployment.redis.start()  # same port, no data: the windows start again
    deadline = time.monotonic() + 10
    while (back := post(deployment.closed_replica.base, "rpm10", service_tier="default")).status_code != 200:
        assert back.status_code == 503 and time.monotonic() < deadline, back.status_code
        time.sleep(0.2)
    assert back.headers["x-ratelimit-remaining-requests"] == "9"
    again = post(deployment.open_replica.base, "rpm10", service_tier="default")
    assert again.status_code == 200 and again.headers["x-ratelimit-remaining-requests"] == "8"


def test_sigterm_drains_a_replica_and_nginx_moves_to_the_other(deployment: Deployment) -> None:
    """A stream through nginx keeps going on the replica that got SIGTERM; new requests all succeed."""
    with httpx.stream("POST", f"{deployment.nginx.base}/v1/completions", timeout=120,
                      json={**SHORT, "max_tokens": 40, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}) as response:
        lines = response.iter_lines()
        next(events(lines))
        running = [gauge(r.base, "trtserver_running_sequences") for r in deployment.replicas]
        assert sorted(running) == [0.0, 1.0], running
        draining, other = (deployment.replicas if running[0] else deployment.replicas[::-1])
        draining.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(f"{draining.base}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "never reported draining"
            time.sleep(0.02)
        during = [post(deployment.nginx.base) for _ in range(4)]  # the draining replica answers 503: nginx retries
        rest = list(events(lines))
    assert [r.status_code for r in during] == [200] * 4
    assert rest[-1] == "[DONE]" and isinstance(rest[-2], dict)
    assert rest[-2]["usage"]["completion_tokens"] == 40  # type: ignore[index]  # the whole answer
    assert draining.process.wait(timeout=60) == 0
    after = [post(deployment.nginx.base) for _ in range(4)]  # gone: connections refused, nginx uses the other
    assert [r.status_code for r in after] == [200] * 4
    assert other.process.poll() is None
