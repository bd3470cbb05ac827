"""Process life cycle of a real ``trtserver serve`` subprocess: loading, client disconnects, SIGTERM
draining, the bounded waiting queue, and an engine directory that fails to load.

Every server here is small (``--max-model-len 1024``, one or four slots) so it starts in seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.http.conftest import TEST_DEVICE, free_port

SMALL = ("--max-model-len", "1024")
# long enough to outlast every timeout and grace period here (~100 tokens/s on two cores); those requests are cut short
LONG = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
# the waiting-bound tests need each request to outlast the arrivals (4 x 0.3 s): 160 tokens take ~3 s at ~55 tok/s
TOKENS_PER_REQUEST = 160
ENVELOPE_KEYS = {"message", "type", "param", "code"}


# --- helpers ------------------------------------------------------------------------------------


class Server:
    """A ``trtserver serve`` subprocess that has not necessarily become healthy yet."""

    def __init__(self, engine_dir: Path, *flags: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"trtserver-test-lifecycle-{self.port}.log"
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "trtserver.cli", "serve", str(engine_dir), "--port", str(self.port),
             "--engine", os.environ.get("TRTSERVER_TEST_ENGINE", "torch"), "--device", TEST_DEVICE, *flags],
            stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        self._log.close()


async def get_json(http_client: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, object]]:
    async with http_client.get(url) as response:
        return response.status, await response.json(content_type=None)


async def wait_ready(server: Server, timeout: float = 120.0) -> list[tuple[int, str]]:
    """Poll /health from the moment the process starts; returns each distinct (status, body status)."""
    seen: list[tuple[int, str]] = []
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http_client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log()[-3000:]}")
            try:
                status, body = await get_json(http_client, f"{server.base}/health")
            except (aiohttp.ClientError, TimeoutError):
                await asyncio.sleep(0.02)
                continue
            if not seen or seen[-1] != (status, body.get("status")):
                seen.append((status, str(body.get("status"))))
            if status == 200:
                return seen
            await asyncio.sleep(0.02)
    raise TimeoutError(f"server did not become healthy; saw {seen}")


async def gauge(http_client: aiohttp.ClientSession, base: str, name: str) -> float:
    async with http_client.get(f"{base}/metrics") as response:
        text = await response.text()
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name} missing from /metrics"
    return float(match.group(1))


async def wait_gauge(base: str, name: str, value: float, timeout: float) -> float:
    """Seconds until the gauge reads ``value``; fails after ``timeout``."""
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http_client:
        while True:
            current = await gauge(http_client, base, name)
            if current == value:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"{name} is {current}, not {value}, {timeout} s later")
            await asyncio.sleep(0.02)


async def wait_idle(base: str, timeout: float = 60.0) -> None:
    await wait_gauge(base, "trtserver_running_sequences", 0, timeout)
    await wait_gauge(base, "trtserver_queue_depth", 0, timeout)


async def data_lines(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The ``data:`` payloads of an SSE response, as they arrive."""
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            yield line[len("data: "):]


async def assert_serves(base: str) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http_client:
        async with http_client.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}) as response:
            assert response.status == 200, await response.text()
            body = await response.json()
    assert body["usage"]["completion_tokens"] >= 1


def assert_envelope(body: object) -> dict[str, object]:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == ENVELOPE_KEYS, body
    assert isinstance(error["message"], str) and error["message"]
    return error


# --- one shared server: one slot, one waiting place ----------------------------------------------


@pytest.fixture(scope="module")
def shared(engine_dir: Path) -> Iterator[tuple[Server, list[tuple[int, str]], list[dict[str, object]]]]:
    """The server, the /health states seen while it started, and what POSTs got while loading."""
    server = Server(engine_dir, *SMALL, "--max-batch-size", "1", "--max-waiting", "1")
    loading_posts: list[dict[str, object]] = []

    async def start() -> list[tuple[int, str]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http_client:
            # wait until it listens, then ask for a completion while the model is (very likely) still loading
            while server.process.poll() is None:
                try:
                    async with http_client.post(f"{server.base}/v1/completions",
                                            json={"prompt": "Hi", "max_tokens": 1}) as response:
                        loading_posts.append({"status": response.status, "retry": response.headers.get("Retry-After"),
                                              "body": await response.json(content_type=None)})
                        break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.02)
        return await wait_ready(server)

    try:
        seen = asyncio.run(start())
        yield server, seen, loading_posts
    finally:
        server.stop()


def test_health_reports_loading_until_the_engine_is_ready(shared: tuple[Server, list, list]) -> None:
    _, seen, loading_posts = shared
    # it listens before the engine loads: first 503 loading, then 200 ok, nothing else in between
    assert seen == [(503, "loading"), (200, "ok")], seen
    post = loading_posts[0]
    if post["status"] == 503:  # a completion asked for while loading is refused, retryable
        error = assert_envelope(post["body"])
        assert error["code"] == "model_loading" and post["retry"] is not None
    else:  # the model won the race: then it must simply have been served
        assert post["status"] == 200, post


async def test_stream_disconnect_frees_the_slot(shared: tuple[Server, list, list]) -> None:
    server = shared[0]
    await wait_idle(server.base)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http_client:
        response = await http_client.post(f"{server.base}/v1/completions", json={**LONG, "stream": True})
        assert response.status == 200
        lines = data_lines(response)
        for _ in range(2):
            chunk = json.loads(await anext(lines))
            assert chunk["choices"][0]["finish_reason"] is None
        async with aiohttp.ClientSession() as probe:
            assert await gauge(probe, server.base, "trtserver_running_sequences") == 1
        response.close()  # drops the connection mid-stream
    freed_after = await wait_gauge(server.base, "trtserver_running_sequences", 0, timeout=2.0)
    assert freed_after < 2.0
    async with aiohttp.ClientSession() as probe:
        assert await gauge(probe, server.base, "trtserver_kv_slots_used") == 0
    await assert_serves(server.base)


async def test_non_streaming_client_timeout_frees_the_slot(shared: tuple[Server, list, list]) -> None:
    server = shared[0]
    await wait_idle(server.base)

    async def impatient() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http_client:
            async with http_client.post(f"{server.base}/v1/completions", json=LONG) as response:
                await response.read()

    task = asyncio.create_task(impatient())
    await wait_gauge(server.base, "trtserver_running_sequences", 1, timeout=2.0)
    with pytest.raises(asyncio.TimeoutError):
        await task  # 1000 tokens take far longer than 2 s on a CPU
    freed_after = await wait_gauge(server.base, "trtserver_running_sequences", 0, timeout=2.0)
    assert freed_after < 2.0
    await assert_serves(server.base)


async def _fire(base: str, count: int, gap_s: float) -> list[tuple[int, str | None, object]]:
    body = {**LONG, "max_tokens": TOKENS_PER_REQUEST}

    async def one(i: int, http_client: aiohttp.ClientSession) -> tuple[int, str | None, object]:
        await asyncio.sleep(i * gap_s)
        async with http_client.post(f"{base}/v1/completions", json=body) as response:
            return response.status, response.headers.get("Retry-After"), await response.json(content_type=None)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http_client:
        # wait_for: a hang is a failure, not a stuck suite
        return await asyncio.wait_for(asyncio.gather(*(one(i, http_client) for i in range(count))), 150)


def _check_bounded(results: list[tuple[int, str | None, object]]) -> None:
    served = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] != 200]
    # one slot + one waiting place: at most two of them are taken on, the rest are refused at once
    assert 1 <= len(served) <= 2, [r[0] for r in results]
    for status, retry_after, body in refused:
        assert status == 503 and retry_after is not None, (status, retry_after, body)
        assert assert_envelope(body)["type"] == "server_overloaded"
    for _, _, body in served:
        assert body["usage"]["completion_tokens"] == TOKENS_PER_REQUEST  # type: ignore[index]


async def test_waiting_queue_bound_arrivals_spread_out(shared: tuple[Server, list, list]) -> None:
    server = shared[0]
    await wait_idle(server.base)
    _check_bounded(await _fire(server.base, 5, gap_s=0.1))  # all in while the first's 160 tokens decode
    await wait_idle(server.base)


async def test_waiting_queue_bound_simultaneous_burst(shared: tuple[Server, list, list]) -> None:
    """All at once: the bound must hold for a burst too, not only for requests a step apart."""
    server = shared[0]
    await wait_idle(server.base)
    _check_bounded(await _fire(server.base, 5, gap_s=0.0))
    await wait_idle(server.base)


async def test_concurrent_requests_with_the_same_x_request_id(shared: tuple[Server, list, list]) -> None:
    """X-Request-Id is the client's label (logs, response id): two requests that reuse one must both be served."""
    server = shared[0]
    await wait_idle(server.base)
    body = {"prompt": "Hi", "max_tokens": 8, "ignore_eos": True}

    async def one(http_client: aiohttp.ClientSession) -> tuple[int, object]:
        async with http_client.post(f"{server.base}/v1/completions", json=body,
                                headers={"X-Request-Id": "client-chosen-id"}) as response:
            return response.status, await response.json(content_type=None)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http_client:
        results = await asyncio.wait_for(asyncio.gather(one(http_client), one(http_client)), 90)
    # neither may be a 500 (a 503 "overloaded" would be the waiting-queue bound, which is fine)
    statuses = [status for status, _ in results]
    assert all(status in (200, 503) for status in statuses) and 200 in statuses, results
    for status, body in results:
        if status == 503:
            assert assert_envelope(body)["type"] == "server_overloaded"
    await wait_idle(server.base)


# --- SIGTERM ---------------------------------------------------------------------------------------


async def test_sigterm_drains_in_flight_stream_and_refuses_new_requests(engine_dir: Path) -> None:
    server = Server(engine_dir, *SMALL, "--max-batch-size", "4", "--shutdown-grace-s", "60")
    try:
        await wait_ready(server)
        tokens = 60
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http_client:
            response = await http_client.post(f"{server.base}/v1/completions", json={
                **LONG, "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True}})
            assert response.status == 200
            lines = data_lines(response)
            first = json.loads(await anext(lines))
            assert first["choices"][0]["finish_reason"] is None
            server.process.send_signal(signal.SIGTERM)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as other:
                deadline = time.monotonic() + 10
                while (await get_json(other, f"{server.base}/health")) != (503, {"status": "draining"}):
                    assert time.monotonic() < deadline, "never reported draining"
                    await asyncio.sleep(0.02)
                # still listening while draining: new work is refused, retryably
                async with other.post(f"{server.base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}) as r:
                    assert r.status == 503 and r.headers.get("Retry-After") is not None
                    assert assert_envelope(await r.json())["type"] == "server_overloaded"
            rest = [line async for line in lines]
        assert rest[-1] == "[DONE]", rest[-3:]
        chunks = [json.loads(line) for line in rest[:-1]]
        assert all("error" not in chunk for chunk in chunks)
        assert chunks[-1]["usage"]["completion_tokens"] == tokens  # the whole answer, not cut short
        assert server.process.wait(timeout=60) == 0
    finally:
        server.stop()


async def test_sigterm_exits_after_grace_even_with_a_long_request(engine_dir: Path) -> None:
    server = Server(engine_dir, *SMALL, "--max-batch-size", "4", "--shutdown-grace-s", "1")
    try:
        await wait_ready(server)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http_client:
            response = await http_client.post(f"{server.base}/v1/completions",
                                          json={**LONG, "stream": True})
            lines = data_lines(response)
            await anext(lines)
            server.process.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            code = await asyncio.to_thread(server.process.wait, 30)
            elapsed = time.monotonic() - t0
            # 1 s grace + aiohttp's 1 s shutdown timeout + one engine step + interpreter exit; waiting for the
            # whole 1000-token answer instead would also end the stream with [DONE] (checked below)
            assert elapsed < 8.0, elapsed
            assert code == 0
            # the client is not left hanging either: its stream ends, cut short, with an error event and [DONE]
            rest = await asyncio.wait_for(_drain_lines(lines), 10)
            assert rest[-1] == "[DONE]", rest[-3:]
            assert assert_envelope(json.loads(rest[-2]))["code"] == "server_shutdown"
    finally:
        server.stop()


async def _drain_lines(lines: AsyncIterator[str]) -> list[str]:
    out = []
    try:
        async for line in lines:
            out.append(line)
    except aiohttp.ClientPayloadError:
        pass
    return out


# --- an engine that cannot load --------------------------------------------------------------------


async def test_engine_that_fails_to_load_exits_non_zero(engine_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken-engine"
    broken.mkdir()
    for item in engine_dir.iterdir():
        if item.name != "config.json":
            (broken / item.name).symlink_to(item)
    (broken / "config.json").write_text('{"vocab_size": 49152, "hidden_size": ')  # truncated JSON
    assert json.loads((engine_dir / "config.json").read_text())  # the original is fine
    server = Server(broken, *SMALL, "--max-batch-size", "1")
    try:
        code = await asyncio.to_thread(server.process.wait, 90)
        assert code != 0
        log = server.log()
        assert "failed to load" in log and "JSONDecodeError" in log, log[-2000:]
    finally:
        server.stop()


