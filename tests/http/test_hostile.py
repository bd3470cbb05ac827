"""Hostile and careless clients: every request the HTTP layer refuses is the OpenAI JSON envelope,
with an ``X-Request-Id``, and never hurts a good request running beside it.

The raw cases are bytes on a loopback socket (so aiohttp's own parser is reached: bad framing,
encodings, headers); each runs while a good streamed completion is in flight and checks it ended
well. One small server serves the module, with API keys, project bindings, a metrics key and
short read deadlines (``hostile.toml`` below).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import signal
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from tests.http.conftest import MODEL, start_server, stop_server
from trtserver.config import TierLimits
from trtserver.http.body import json_depth
from trtserver.quota import WINDOW_S, MemoryQuotaStore

GOOD_KEY, ALPHA_KEY, METRICS_KEY = "k-good", "k-alpha", "k-metrics"
HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 1.5, 2.0
CONFIG = f"""
[server]
api_keys = ["{GOOD_KEY}", "{ALPHA_KEY}"]
metrics_api_keys = ["{METRICS_KEY}"]
header_timeout_s = {HEADER_TIMEOUT_S}
body_timeout_s = {BODY_TIMEOUT_S}
max_batch_size = 4
max_model_len = 1024

[server.api_key_projects]
{ALPHA_KEY} = ["alpha", "alpha-2"]

[server.quotas.alpha]
requests_per_minute = 3
"""
ENVELOPE_KEYS = {"message", "type", "param", "code"}
OK = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
SECRET = "PROMPT-THAT-MUST-NOT-BE-LOGGED-4417"


@dataclass
class Server:
    base: str
    port: int
    log: Path


@pytest.fixture(scope="module")
def server(engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = tmp_path_factory.mktemp("hostile") / "hostile.toml"
    config.write_text(CONFIG)
    process, base = start_server(engine_dir, "--config", str(config), log_name="hostile")
    port = int(base.rsplit(":", 1)[1])
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"trtserver-test-hostile-{port}.log"
    yield Server(base, port, log)
    stop_server(process)


# --- raw HTTP on a socket ----------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> object:
        return json.loads(self.body)


def request_bytes(body: bytes = b"", *, method: str = "POST", path: str = "/v1/completions",
                  headers: dict[str, bytes | str] | None = None, key: str | None = GOOD_KEY,
                  length: bool = True, close: bool = True) -> bytes:
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1"] + ([b"Connection: close"] if close else [])
    if key is not None:
        lines.append(f"Authorization: Bearer {key}".encode())
    merged: dict[str, bytes | str] = {"Content-Type": "application/json", **(headers or {})}
    if length and "Content-Length" not in merged and "Transfer-Encoding" not in merged:
        merged["Content-Length"] = str(len(body))
    for name, value in merged.items():
        lines.append(name.encode() + b": " + (value if isinstance(value, bytes) else value.encode()))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def parse_replies(data: bytes, head_only: bool = False) -> list[Reply]:
    """Every HTTP/1.1 response in ``data`` (a connection's whole output)."""
    replies = []
    while data.startswith(b"HTTP/1."):
        head, _, rest = data.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if head_only:
            body, data = b"", rest
        elif headers.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                size_line, _, rest = rest.partition(b"\r\n")
                size = int(size_line, 16)
                body, rest = body + rest[:size], rest[size + 2:]
                if size == 0:
                    break
            data = rest
        else:
            size = int(headers.get("content-length", "0"))
            body, data = rest[:size], rest[size:]
        replies.append(Reply(int(status_line.split()[1]), headers, body))
    return replies


async def exchange(port: int, pieces: list[bytes], *, pause_s: float = 0.0, timeout_s: float = 20.0,
                   head_only: bool = False) -> tuple[list[Reply], float]:
    """Send ``pieces`` (``pause_s`` apart), read until the server closes; the replies and the seconds taken."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = b""
    try:
        async def send() -> None:
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                if pause_s:
                    await asyncio.sleep(pause_s)

        sender = asyncio.create_task(send())
        try:
            received = await asyncio.wait_for(reader.read(-1), timeout_s)
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
    finally:
        writer.close()
    return parse_replies(received, head_only), time.monotonic() - t0


async def good_stream(base: str) -> None:
    """A well-behaved streamed completion; it must end with [DONE] and no error, whatever runs beside it."""
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async with http.post(f"{base}/v1/completions", json={**OK, "max_tokens": 3, "stream": True},
                                headers={"Authorization": f"Bearer {GOOD_KEY}", "X-Request-Id": "good-1"}) as r:
            assert r.status == 200, await r.text()
            assert r.headers["X-Request-Id"] == "good-1"
            text = await r.text()
    events = [line for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]", events[-3:]
    assert all('"error"' not in event for event in events), events


def assert_envelope(reply: Reply, status: int) -> dict[str, object]:
    assert reply.status == status, (reply.status, reply.body[:300])
    assert reply.headers.get("content-type", "").startswith("application/json"), reply.headers
    assert reply.headers.get("x-request-id"), reply.headers
    body = reply.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == ENVELOPE_KEYS and error["message"], error
    return error


def nested(depth: int, kind: str = "array") -> str:
    return "[" * depth + "]" * depth if kind == "array" else '{"a":' * depth + "1" + "}" * depth


def body_with(field: str, depth: int, kind: str = "array") -> bytes:
    return f'{{"prompt": "Hi", "max_tokens": 1, "{field}": {nested(depth, kind)}}}'.encode()


def chunked(body: bytes, size_line: bytes | None = None) -> bytes:
    head = size_line if size_line is not None else b"%x" % len(body)
    return head + b"\r\n" + body + b"\r\n0\r\n\r\n"


PLAIN = json.dumps(OK).encode()
STREAMED = json.dumps({**OK, "stream": True}).encode()
MANY_HEADERS: dict[str, bytes | str] = {f"X-Filler-{i}": "x" for i in range(200)}

# (name, bytes sent, status, param or ... for "any")
RAW_CASES: list[tuple[str, bytes, int, object]] = [
    *((f"deep {kind} {depth} in {field}", body_with(field, depth, kind), 400, None)
      for field in ("unknown_field", "extra_body", "guided_json", "prompt", "logits_processors")
      for depth, kind in ((1000, "array"), (10000, "array"), (10000, "object"))),
    ("deep 200 in guided_json (under msgspec's own limit)", body_with("guided_json", 200, "object"), 400, None),
    ("deep prompt 100000", f'{{"prompt": {nested(100000)}}}'.encode(), 400, None),
    ("gzip header, plain body", request_bytes(PLAIN, headers={"Content-Encoding": "gzip"}), 400, None),
    ("deflate header, plain body", request_bytes(PLAIN, headers={"Content-Encoding": "deflate"}), 400, None),
    ("gzip header, corrupt gzip", request_bytes(gzip.compress(PLAIN)[:10] + b"\x00garbage" * 8,
                                                headers={"Content-Encoding": "gzip"}), 400, None),
    ("br body", request_bytes(b"\x8b\x05\x80" + PLAIN, headers={"Content-Encoding": "br"}), 415, None),
    ("unknown content-encoding", request_bytes(PLAIN, headers={"Content-Encoding": "zip-zap"}), 415, ...),
    ("X-Request-Id utf-8", request_bytes(PLAIN, headers={"X-Request-Id": "req-é".encode()}), 400, "X-Request-Id"),
    ("X-Request-Id latin-1 byte", request_bytes(PLAIN, headers={"X-Request-Id": b"req-\xff"}), 400, "X-Request-Id"),
    ("X-Request-Id utf-8, streamed", request_bytes(STREAMED, headers={"X-Request-Id": "☃".encode()}), 400,
     "X-Request-Id"),
    ("X-Request-Id too long", request_bytes(PLAIN, headers={"X-Request-Id": "r" * 300}), 400, "X-Request-Id"),
    ("body request_id non-ASCII", request_bytes(json.dumps({**OK, "request_id": "é"}).encode()), 400,
     "request_id"),
    ("Content-Length not a number", request_bytes(PLAIN, headers={"Content-Length": "abc"}), 400, None),
    ("Content-Length negative", request_bytes(PLAIN, headers={"Content-Length": "-5"}), 400, None),
    ("two Content-Lengths", request_bytes(PLAIN, headers={"Content-Length": f"{len(PLAIN)}, 3"}), 400, None),
    ("too many headers", request_bytes(PLAIN, headers=MANY_HEADERS), 400, None),
    ("header too long", request_bytes(PLAIN, headers={"X-Long": "y" * 20000}), 400, None),
    ("bad chunk size", request_bytes(chunked(PLAIN, b"zz"), headers={"Transfer-Encoding": "chunked"}), 400, None),
    ("chunk longer than its size", request_bytes(chunked(PLAIN, b"5"), headers={"Transfer-Encoding": "chunked"}),
     400, None),
    ("Expect: bogus", request_bytes(PLAIN, headers={"Expect": "bogus"}), 417, "Expect"),
    ("garbage request line", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400, None),
    ("non-UTF-8 API key", request_bytes(PLAIN, key=None, headers={"Authorization": b"Bearer k-\xff\xfe"}), 401, None),
    ("bad project id length", request_bytes(PLAIN, path="/v1/completions?ai_project_id=" + "p" * 7000), 400,
     "ai_project_id"),
]


def _wrap(data: bytes) -> bytes:
    return data if data.startswith((b"POST ", b"GET ", b"HEAD ", b"\x16")) else request_bytes(data)


@pytest.mark.parametrize("name, data, status, param", RAW_CASES, ids=[c[0] for c in RAW_CASES])
async def test_refused_with_the_envelope(server: Server, name: str, data: bytes, status: int, param: object) -> None:
    good = asyncio.create_task(good_stream(server.base))
    replies, _ = await exchange(server.port, [_wrap(data)])
    assert replies, f"{name}: no response"
    error = assert_envelope(replies[0], status)
    if param is not ...:
        assert error["param"] == param, error
    await asyncio.wait_for(good, 60)


async def test_gzip_and_deflate_bodies_are_decoded(server: Server) -> None:
    for encoding, data in (("gzip", gzip.compress(PLAIN)), ("deflate", zlib.compress(PLAIN))):
        replies, _ = await exchange(server.port, [request_bytes(data, headers={"Content-Encoding": encoding})])
        assert replies[0].status == 200, replies[0].body
        assert replies[0].json()["choices"][0]["text"]  # type: ignore[index]


async def test_brackets_inside_strings_do_not_count_as_nesting(server: Server) -> None:
    prompt = "[" * 150 + '"\\' + "{" * 150
    replies, _ = await exchange(server.port, [request_bytes(json.dumps({**OK, "prompt": prompt}).encode())])
    assert replies[0].status == 200, replies[0].body


async def test_head_with_401_is_json(server: Server) -> None:
    good = asyncio.create_task(good_stream(server.base))
    replies, _ = await exchange(server.port, [request_bytes(method="HEAD", path="/v1/models", key=None, length=False)],
                                head_only=True)
    assert replies[0].status == 401
    assert replies[0].headers["content-type"].startswith("application/json")
    assert int(replies[0].headers["content-length"]) > 0  # the envelope's length; HEAD carries no body
    assert replies[0].headers["x-request-id"]
    await asyncio.wait_for(good, 60)


async def test_short_content_length_keeps_the_body_out_of_the_log(server: Server) -> None:
    body = json.dumps({**OK, "prompt": f"{SECRET} " * 3}).encode()
    replies, _ = await exchange(server.port, [request_bytes(body, headers={"Content-Length": "10"}, close=False)])
    assert replies, "no response"
    for reply in replies:
        assert_envelope(reply, 400)
    await asyncio.sleep(0.3)
    assert SECRET not in server.log.read_text(errors="replace")


async def test_slow_header_sender_is_timed_out(server: Server) -> None:
    data = request_bytes(PLAIN)
    good = asyncio.create_task(good_stream(server.base))
    replies, took = await exchange(server.port, [data[i:i + 1] for i in range(60)], pause_s=0.2, timeout_s=15)
    assert took < HEADER_TIMEOUT_S + 6, took
    assert_envelope(replies[0], 408)
    await asyncio.wait_for(good, 60)


async def test_slow_body_sender_is_timed_out(server: Server) -> None:
    data = request_bytes(PLAIN)
    head, body = data[:data.index(b"\r\n\r\n") + 4], data[data.index(b"\r\n\r\n") + 4:]
    good = asyncio.create_task(good_stream(server.base))
    replies, took = await exchange(server.port, [head] + [body[i:i + 1] for i in range(len(body))], pause_s=0.3,
                                   timeout_s=15)
    assert took < BODY_TIMEOUT_S + 6, took  # + aiohttp's lingering close
    assert_envelope(replies[0], 408)
    await asyncio.wait_for(good, 60)


# --- request ids -----------------------------------------------------------------------------------


async def test_every_response_names_its_request(server: Server) -> None:
    auth = {"Authorization": f"Bearer {GOOD_KEY}"}
    async with aiohttp.ClientSession(base_url=server.base) as http:
        async with http.post("/v1/completions", json=OK, headers={**auth, "X-Request-Id": "abc-1"}) as r:
            assert r.status == 200 and r.headers["X-Request-Id"] == "abc-1"
        async with http.post("/v1/completions", json={**OK, "stream": True},
                                headers={**auth, "X-Request-Id": "abc-2"}) as r:
            assert r.status == 200 and r.headers["X-Request-Id"] == "abc-2"
            assert (await r.text()).rstrip().endswith("data: [DONE]")
        async with http.post("/v1/completions", json={**OK, "request_id": "from-body"}, headers=auth) as r:
            assert r.headers["X-Request-Id"] == "from-body"
            assert (await r.json())["id"] == "cmpl-from-body"
        for method, path, headers, status in (("POST", "/v1/completions", {}, 401), ("GET", "/v1/nothing", auth, 404),
                                              ("GET", "/health", {}, 200), ("GET", "/v1/models", auth, 200)):
            async with http.request(method, path, headers={**headers, "X-Request-Id": "abc-3"}) as r:
                assert r.status == status and r.headers["X-Request-Id"] == "abc-3"
        async with http.get("/health") as r:
            assert len(r.headers["X-Request-Id"]) >= 16  # a fresh one when the client sent none


# --- leaks -----------------------------------------------------------------------------------------


async def test_models_root_is_the_model_id(server: Server) -> None:
    async with aiohttp.ClientSession(base_url=server.base) as http:
        async with http.get("/v1/models", headers={"Authorization": f"Bearer {GOOD_KEY}"}) as r:
            card = (await r.json())["data"][0]
    assert card["root"] == card["id"] == MODEL
    assert "/" not in card["root"]


async def test_metrics_need_the_metrics_key_and_name_no_client(server: Server) -> None:
    async with aiohttp.ClientSession(base_url=server.base) as http:
        await http.post("/v1/completions", json={**OK, "user": "alice@example.com"},
                           headers={"Authorization": f"Bearer {GOOD_KEY}", "X-Request-Id": "who-asked-1"})
        openmetrics = {"Accept": "application/openmetrics-text"}
        for key in (None, GOOD_KEY, "nope"):
            headers = openmetrics if key is None else {**openmetrics, "Authorization": f"Bearer {key}"}
            async with http.get("/metrics", headers=headers) as r:
                assert r.status == 401
                assert (await r.json())["error"]["type"] == "authentication_error"
        async with http.get("/metrics", headers={**openmetrics, "Authorization": f"Bearer {METRICS_KEY}"}) as r:
            assert r.status == 200
            text = await r.text()
    assert "trtserver_request_latency_seconds" in text
    assert "alice" not in text and "who-asked-1" not in text and "request_id=" not in text


# --- projects and quotas ---------------------------------------------------------------------------


async def post_as(http: aiohttp.ClientSession, key: str, project: str | None,
                  body: object) -> aiohttp.ClientResponse:
    url = "/v1/completions" + (f"?ai_project_id={project}" if project is not None else "")
    async with http.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        await r.read()
        return r


async def test_keys_are_bound_to_their_projects(server: Server) -> None:
    async with aiohttp.ClientSession(base_url=server.base) as http:
        for key, project in ((ALPHA_KEY, "beta"), (ALPHA_KEY, "never-configured"), (GOOD_KEY, "alpha")):
            async with http.post(f"/v1/completions?ai_project_id={project}", json=OK,
                                    headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status == 403, (key, project)
                error = (await r.json())["error"]
                assert error["type"] == "permission_error" and error["param"] == "ai_project_id"
        assert (await post_as(http, ALPHA_KEY, "alpha-2", OK)).status == 200
        assert (await post_as(http, GOOD_KEY, None, OK)).status == 200


async def test_refused_requests_do_not_count_against_the_quota(server: Server) -> None:
    invalid = {**OK, "service_tier": "default", "max_tokens": 100000}  # refused after the quota is checked
    good = {**OK, "service_tier": "default", "max_tokens": 1}
    async with aiohttp.ClientSession(base_url=server.base) as http:
        for _ in range(5):
            assert (await post_as(http, ALPHA_KEY, "alpha", invalid)).status == 400
        # alpha allows 3 a minute; a key bound to projects that names none counts against its first
        statuses = [(await post_as(http, ALPHA_KEY, project, good)).status for project in ("alpha", None, "alpha")]
        assert statuses == [200, 200, 200]
        over = await post_as(http, ALPHA_KEY, "alpha", good)
        assert over.status == 429


def test_json_depth_counts_structure_not_strings() -> None:
    assert json_depth(b'{"prompt": [1, 2, 3]}') == 2
    assert json_depth(b'{"a": [1, {"b": "[[[[{{{{"}]}') == 3
    assert json_depth(b'{"a": "say \\"[[[\\" twice", "b": [[["\\\\"]]]}') == 4
    assert json_depth(b"[" * 5000 + b"]" * 5000) == 5000
    assert json_depth(b"") == json_depth(b'"[["') == 0


def test_quota_store_is_bounded() -> None:
    store = MemoryQuotaStore(max_projects=100)
    limits = TierLimits(requests_per_minute=1)
    for i in range(1000):
        assert store.acquire(f"project-{i}", limits, now=1.0 + i * 1e-3).allowed
    assert len(store) == 100  # the least recently used are forgotten past the bound
    assert not store.acquire("project-999", limits, now=2.0).allowed  # a recent one keeps its count
    store.acquire("late", limits, now=2.0 + WINDOW_S + 1)
    assert len(store) == 1  # idle windows expire: they hold no counts
    at = 100.0
    assert store.acquire("refunded", limits, now=at).allowed
    store.refund("refunded", at)
    assert store.acquire("refunded", limits, now=at + 1).allowed


# --- SIGTERM ---------------------------------------------------------------------------------------


async def test_sigterm_cuts_off_long_streams_with_an_error_event_and_done(engine_dir: Path) -> None:
    process, base = start_server(engine_dir, "--max-model-len", "1024", "--max-batch-size", "4",
                                 "--shutdown-grace-s", "1", log_name="hostile-sigterm")
    try:
        long = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            async def stream() -> list[str]:
                async with http.post(f"{base}/v1/completions", json={**long, "stream": True}) as r:
                    assert r.status == 200
                    lines = []
                    async for raw in r.content:
                        line = raw.decode().strip()
                        if line.startswith("data: "):
                            lines.append(line[6:])
                            if len(lines) == 1:
                                started.set()
                    return lines

            async def whole() -> tuple[int, object]:
                await started.wait()
                async with http.post(f"{base}/v1/completions", json=long) as r:
                    return r.status, await r.json()

            started = asyncio.Event()
            streaming, waiting = asyncio.create_task(stream()), asyncio.create_task(whole())
            await started.wait()
            await asyncio.sleep(0.3)
            process.send_signal(signal.SIGTERM)
            lines = await asyncio.wait_for(streaming, 30)
            status, body = await asyncio.wait_for(waiting, 30)
        assert lines[-1] == "[DONE]", lines[-3:]
        error = json.loads(lines[-2])["error"]
        assert set(error) == ENVELOPE_KEYS and error["code"] == "server_shutdown"
        assert status == 503 and body["error"]["code"] == "server_shutdown"  # type: ignore[index]
        assert await asyncio.to_thread(process.wait, 30) == 0
    finally:
        stop_server(process)
