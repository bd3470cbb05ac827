"""Streamed tokens written from the engine's dispatch (``take`` in ``CompletionService._chunks``,
``push_to`` on the PyTorch engine), on the real model: the bytes a client gets are those of the
pulled stream, however the two paths take turns."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from trtserver import hookimpl
from trtserver.protocol import CompletionResponse
from trtserver.sse import EventWriter
from trtserver.testing import serve
from trtserver.text import StopMatch

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "Once upon a time"


class FailingStop:
    """A plugin's stop checker that breaks on its ``fail_at``-th call."""

    def __init__(self, fail_at: int) -> None:
        self.calls = 0
        self.fail_at = fail_at

    def find(self, text: str, new_from: int) -> StopMatch | None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("the plugin's stop checker broke")
        return None

    def hold(self, text: str) -> int:
        return 0


class BreakingPlugin:
    @hookimpl
    def trtserver_stop_checkers(self, request: Any, context: Any) -> list[Callable[[], Any]] | None:
        fail_at = context.extra.get("fail_at")
        return [lambda: FailingStop(int(fail_at))] if fail_at else None


@pytest.fixture(scope="module", params=[True, False], ids=["engine-process", "engine-thread"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[TestClient[Any, Any]]:
    async with serve([BreakingPlugin()], installed_plugins=False, engine_process=request.param) as test_client:
        yield test_client


@pytest.fixture
def pushed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[CompletionResponse]]:
    """The chunks written through the sink, in order."""
    chunks: list[CompletionResponse] = []
    write = EventWriter.write

    def spy(self: EventWriter, chunk: CompletionResponse) -> None:
        chunks.append(chunk)
        write(self, chunk)

    monkeypatch.setattr(EventWriter, "write", spy)
    yield chunks


async def events(client: TestClient[Any, Any], **body: Any) -> list[dict[str, Any]]:
    response = await client.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, "stream": True,
                                                           "stream_options": {"include_usage": True}, **body})
    assert response.status == 200
    lines = [line[6:] for line in (await response.text()).split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def text_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


async def whole(client: TestClient[Any, Any], max_tokens: int) -> str:
    response = await client.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0,
                                                           "max_tokens": max_tokens})
    return str((await response.json())["choices"][0]["text"])


async def test_tokens_after_the_first_are_pushed_and_match_the_collected_response(
        client: TestClient[Any, Any], pushed: list[CompletionResponse]) -> None:
    expected = await whole(client, 16)
    chunks = await events(client, max_tokens=16)
    assert text_of(chunks) == expected
    # the first token goes with the headers and the final one through the pulled stream
    assert 10 <= len(pushed) <= 14
    assert [c.choices[0].text for c in pushed] == [c["choices"][0]["text"] for c in chunks[1:1 + len(pushed)]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 16


async def test_a_stop_string_met_in_a_pushed_token_ends_the_stream(
        client: TestClient[Any, Any], pushed: list[CompletionResponse]) -> None:
    expected = await whole(client, 32)
    words = expected.split()
    stop = next(w for w in words[4:] if expected.index(w) > len(" ".join(words[:4])))
    chunks = await events(client, max_tokens=32, stop=[stop])
    assert text_of(chunks) == expected[:expected.index(stop)]
    last = chunks[-2]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)
    assert pushed and pushed[-1].choices[0].finish_reason == "stop"  # it ended inside the push
    assert chunks[-1]["usage"]["completion_tokens"] < 32


async def test_tokens_declined_while_the_socket_is_busy_keep_their_order(
        client: TestClient[Any, Any], pushed: list[CompletionResponse], monkeypatch: pytest.MonkeyPatch) -> None:
    expected = await whole(client, 24)
    writable = EventWriter.writable
    calls = 0

    def every_other(self: EventWriter) -> bool:
        nonlocal calls
        calls += 1
        return calls % 2 == 0 and writable(self)

    monkeypatch.setattr(EventWriter, "writable", every_other)
    chunks = await events(client, max_tokens=24)
    assert text_of(chunks) == expected
    assert 6 <= len(pushed) <= 16  # both paths took turns


async def test_a_plugin_failing_in_a_pushed_token_ends_with_an_error_event(
        client: TestClient[Any, Any], pushed: list[CompletionResponse]) -> None:
    response = await client.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, "stream": True,
                                                           "max_tokens": 32, "fail_at": 6})
    lines = [line for line in (await response.text()).split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["type"] == "internal_error"
    assert len(lines) - 2 == 5 and len(pushed) == 4  # five tokens, then the error
    assert await whole(client, 4)  # the server still answers
