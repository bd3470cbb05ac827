"""The first working slice, as a client sees it: the official openai SDK against the real model."""

from __future__ import annotations

import concurrent.futures
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.http.conftest import MODEL, start_server, stop_server

PROMPT = "The capital of France is"


def test_models_lists_the_served_model(client: OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_health(http: httpx.Client) -> None:
    response = http.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_greedy_completion_is_real(client: OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    choice = completion.choices[0]
    assert "Paris" in choice.text
    assert choice.finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == 5
    assert completion.usage.completion_tokens == 16
    assert completion.usage.total_tokens == 21
    assert completion.object == "text_completion"
    assert completion.id.startswith("cmpl-")


def test_streaming_arrives_token_by_token_and_matches(client: OpenAI) -> None:
    # seeded: neither takes a cached prefix, whose shorter prefill may round a near tie apart
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, seed=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, seed=0,
                                            stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) >= 8  # one chunk per token (a few may merge for multi-byte characters)
    assert "".join(texts) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_stream_ends_with_done(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_stream_bytes_on_the_wire(base_url: str, client: OpenAI, version: str) -> None:
    """Events after the first go straight to the socket: chunk-framed for HTTP/1.1, bare for HTTP/1.0
    (which ends the body by closing)."""
    # seeded: neither takes a cached prefix, whose shorter prefill may round a near tie apart
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, seed=0).choices[0].text
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "seed": 0,
                       "stream": True})
    url = httpx.URL(base_url)
    with socket.create_connection((url.host, url.port), timeout=60) as sock:
        sock.sendall(f"POST /v1/completions HTTP/{version}\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}".encode())
        raw = b""
        while data := sock.recv(65536):
            raw += data
    head, _, payload = raw.partition(b"\r\n\r\n")
    if version == "1.1":
        assert b"transfer-encoding: chunked" in head.lower()
        events, rest = b"", payload
        while True:  # undo the chunked framing: size line, data, CRLF; a zero size ends it
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            events, rest = events + rest[:size], rest[size + 2:]
    else:
        assert b"transfer-encoding" not in head.lower()
        events = payload
    lines = [line for line in events.decode().split("\n\n") if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]]
    assert len(texts) >= 8 and "".join(texts) == full


def _alone_and_together(client: OpenAI) -> tuple[list[str], list[str]]:
    """Greedy answers to two prompts sent alone, then to ten prompts sent at once (more rows than
    the CPU engine's small-batch kernels take). Seeded, as batch invariance promises: a seeded
    request takes no cached prefix, whose shorter prefill may round a near tie apart."""
    prompts = [f"Count to {i}:" for i in range(3, 13)]

    def one(prompt: str) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                         seed=0).choices[0].text

    alone = [one(p) for p in prompts[:2]]
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        together = list(pool.map(one, prompts))
    return alone, together


def test_concurrent_requests_all_answer(client: OpenAI) -> None:
    # by default a batch above 4 rows (8 with the engine's own int4 kernel) takes other kernels than one
    # alone, which may change a near tie
    _, together = _alone_and_together(client)
    assert all(together) and len(together) == 10


@pytest.fixture(scope="module")
def invariant_client(engine_dir: Path) -> Iterator[OpenAI]:
    process, base = start_server(engine_dir, "--batch-invariant", log_name="batch-invariant")
    try:
        yield OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        stop_server(process)


def test_batch_invariant_server_answers_the_same_alone_and_in_a_crowd(invariant_client: OpenAI,
                                                                      client: OpenAI) -> None:
    alone, together = _alone_and_together(invariant_client)
    assert all(together)
    assert together[:2] == alone  # batching does not change greedy output
    # other kernels (and, by default, int4 weights) may give other tokens: the fingerprints say so
    def fingerprint(c: OpenAI) -> str | None:
        return c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).system_fingerprint

    assert fingerprint(invariant_client) != fingerprint(client)


def test_seed_repeats(client: OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                         seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1
