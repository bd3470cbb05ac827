"""Streamed tokens written from the engine's dispatch (``take`` in ``CompletionService._chunks``,
``push_to`` on the PyTorch engine). The bytes a client gets are those of the pulled stream, however
the two paths take turns.

Most tests script the engine's deltas (``Scripted``: the real app, tokenizer and service, with
deltas handed in by the test when the reader waits), so which path a delta takes is decided, not
timed. The last ones run the real model on the engine process and on the engine thread."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient

from trtserver import hookimpl
from trtserver.engine.base import GenerationRequest, SequenceOutput
from trtserver.engine.torch.runner import Mailbox, RequestStreams
from trtserver.protocol import CompletionResponse
from trtserver.server import STATE
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


class Scripted(RequestStreams):
    """The served engine's tokenizer and info; deltas come from the test."""

    def __init__(self, real: Any) -> None:
        super().__init__()
        self.real = real
        self.info, self.tokenizer = real.info, real.tokenizer
        self.submitted: asyncio.Queue[GenerationRequest] = asyncio.Queue()
        self.aborted: list[tuple[str, int | None]] = []

    def stats(self) -> Any:
        return self.real.stats()

    def generate(self, request: GenerationRequest) -> AsyncIterator[SequenceOutput]:
        return super().generate(request, max(1, request.n))

    def _submit(self, request: GenerationRequest, box: Mailbox) -> None:
        self._boxes[request.request_id] = box
        self.submitted.put_nowait(request)

    def abort(self, request_id: str, index: int | None = None) -> None:
        self.aborted.append((request_id, index))

    def box(self, request_id: str) -> Mailbox:
        return self._boxes[request_id]

    async def parked(self, request_id: str) -> None:
        """Until the request's reader waits for its next delta with nothing queued."""
        for _ in range(500):
            box = self._boxes.get(request_id)
            waiter = box._waiter if box is not None else None  # noqa: SLF001 - what push_to looks at
            if waiter is not None and not waiter.done() and not box.items:  # type: ignore[union-attr]
                return
            await asyncio.sleep(0.01)
        raise TimeoutError("the reader never waited")

    def send(self, request_id: str, *tokens: int, finish: str | None = None) -> None:
        self._dispatch([SequenceOutput(request_id, 0, list(tokens), finish_reason=finish)], [])  # type: ignore[arg-type]


@pytest.fixture(scope="module")
async def client() -> AsyncIterator[TestClient[Any, Any]]:
    async with serve([BreakingPlugin()], installed_plugins=False) as test_client:
        yield test_client


@pytest.fixture
def scripted(client: TestClient[Any, Any], monkeypatch: pytest.MonkeyPatch) -> Scripted:
    service = client.app[STATE].service
    engine = Scripted(service.engine)
    monkeypatch.setattr(service, "engine", engine)
    return engine


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


def token_ids(client: TestClient[Any, Any], text: str) -> list[int]:
    return list(client.app[STATE].service.tokenizer.encode(text))


async def start(client: TestClient[Any, Any], scripted: Scripted, first: int,
                **body: Any) -> tuple[ClientResponse, str]:
    """A streaming request, its first token sent (the headers go out with its chunk)."""
    posting = asyncio.ensure_future(client.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}, **body}))
    rid = (await asyncio.wait_for(scripted.submitted.get(), 30)).request_id
    scripted.send(rid, first)
    response = await posting
    assert response.status == 200
    return response, rid


async def events(response: ClientResponse) -> list[dict[str, Any]]:
    lines = [line[6:] for line in (await response.text()).split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def texts(chunks: list[dict[str, Any]]) -> list[str]:
    return [c["choices"][0]["text"] for c in chunks if c.get("choices")]


async def test_tokens_sent_while_the_reader_waits_are_pushed_in_order(
        client: TestClient[Any, Any], scripted: Scripted, pushed: list[CompletionResponse]) -> None:
    ids = token_ids(client, " there was a small town by the sea")
    response, rid = await start(client, scripted, ids[0])
    for token in ids[1:-1]:
        await scripted.parked(rid)
        scripted.send(rid, token)
    await scripted.parked(rid)
    scripted.send(rid, ids[-1], finish="length")  # a final delta: declined, so the generator ends it
    chunks = await events(response)
    assert "".join(texts(chunks)) == " there was a small town by the sea"
    assert [c.choices[0].text for c in pushed] == texts(chunks)[1:-1]  # all but the first and the last
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == len(ids)


async def test_tokens_queued_or_declined_come_through_the_generator_in_order(
        client: TestClient[Any, Any], scripted: Scripted, pushed: list[CompletionResponse],
        monkeypatch: pytest.MonkeyPatch) -> None:
    ids = token_ids(client, " one two three four five six seven")
    writable = EventWriter.writable
    calls = 0

    def every_other(self: EventWriter) -> bool:
        nonlocal calls
        calls += 1
        return calls % 2 == 0 and writable(self)

    monkeypatch.setattr(EventWriter, "writable", every_other)
    response, rid = await start(client, scripted, ids[0])
    await scripted.parked(rid)
    scripted.send(rid, ids[1])
    scripted.send(rid, ids[2])  # the reader woke for the first, so this one queues behind it
    for token in ids[3:]:
        await scripted.parked(rid)
        scripted.send(rid, token)
    await scripted.parked(rid)
    scripted.send(rid, finish="length")
    chunks = await events(response)
    assert "".join(texts(chunks)) == " one two three four five six seven"
    assert 0 < len(pushed) < len(ids) - 1


async def test_a_stop_string_met_in_a_pushed_token_ends_the_stream_and_the_engine_request(
        client: TestClient[Any, Any], scripted: Scripted, pushed: list[CompletionResponse]) -> None:
    ids = token_ids(client, " the cat sat on the mat and slept")
    response, rid = await start(client, scripted, ids[0], stop=["mat"])
    for token in ids[1:]:
        await scripted.parked(rid)
        scripted.send(rid, token)
        if pushed and pushed[-1].choices[0].finish_reason is not None:
            break
    chunks = await events(response)
    assert "".join(texts(chunks)) == " the cat sat on the "
    assert (chunks[-2]["choices"][0]["finish_reason"], chunks[-2]["choices"][0]["stop_reason"]) == ("stop", "mat")
    assert pushed[-1].choices[0].finish_reason == "stop"  # written by the push, then the stream ended
    assert (rid, 0) in scripted.aborted and (rid, None) in scripted.aborted
    assert not scripted._boxes  # noqa: SLF001 - the request is forgotten


async def test_a_plugin_failing_in_a_pushed_token_ends_with_an_error_and_aborts_the_request(
        client: TestClient[Any, Any], scripted: Scripted, pushed: list[CompletionResponse]) -> None:
    ids = token_ids(client, " a b c d e f g h")
    response, rid = await start(client, scripted, ids[0], fail_at=4)
    for token in ids[1:4]:
        await scripted.parked(rid)
        scripted.send(rid, token)
    lines = [line for line in (await response.text()).split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["type"] == "internal_error"
    assert len(lines) == 5 and len(pushed) == 2  # three tokens, then the error
    assert (rid, None) in scripted.aborted  # the engine stops generating for nobody


@pytest.fixture(scope="module", params=[True, False], ids=["engine-process", "engine-thread"])
async def real(request: pytest.FixtureRequest) -> AsyncIterator[TestClient[Any, Any]]:
    async with serve(engine_process=request.param) as test_client:
        yield test_client


async def test_the_real_engine_pushes_and_the_text_is_the_collected_response(
        real: TestClient[Any, Any], pushed: list[CompletionResponse]) -> None:
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 24}
    whole = (await (await real.post("/v1/completions", json=body)).json())["choices"][0]["text"]
    chunks = await events(await real.post("/v1/completions", json={**body, "stream": True}))
    assert "".join(texts(chunks)) == whole
    assert pushed  # how many depends on timing: a delta that arrives while the reader is busy is pulled
    streamed = iter(texts(chunks))
    assert all(any(c.choices[0].text == t for t in streamed) for c in pushed)  # in the stream's order
