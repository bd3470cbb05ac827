"""The scripted engine behind the real app: what a script says comes out, shaped as the real model's output."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from trtserver import hookimpl
from trtserver.scripted_engine import (
    CHAT_TEMPLATE,
    ScriptCall,
    reply,
    scripted_tokenizer,
    write_engine_dir,
)
from trtserver.testing import scripted_engine, serve_scripted
from trtserver.text import IncrementalDecoder
from trtserver.tokenizer import Tokenizer

TOKENIZER = scripted_tokenizer()


async def complete(client: TestClient[Any, Any], **body: Any) -> tuple[int, Any]:
    response = await client.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": 16, **body})
    return response.status, await response.json()


def test_the_vocabulary_is_small_byte_level_and_the_same_from_its_engine_directory(tmp_path: Path) -> None:
    from_dir = Tokenizer.from_dir(write_engine_dir(tmp_path))
    assert 300 <= from_dir.vocab_size <= 512 and from_dir.token_bytes is not None
    assert (from_dir.bos_token_id, from_dir.eos_token_ids) == (TOKENIZER.bos_token_id, TOKENIZER.eos_token_ids)
    assert from_dir.special_tokens == TOKENIZER.special_tokens
    assert [from_dir.id_to_token(i) for i in range(3)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    text = "Any text at all: naïve 日本語 🎉"
    ids = from_dir.encode(text)
    assert ids == TOKENIZER.encode(text) and from_dir.decode(ids) == text
    assert IncrementalDecoder(from_dir).feed(ids) == text
    assert (tmp_path / "chat_template.jinja").read_text() == CHAT_TEMPLATE


async def test_default_script_echoes_the_prompt_then_stops() -> None:
    async with serve_scripted(installed_plugins=False) as client:
        status, body = await complete(client)
        assert status == 200
        choice = body["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == ("Hello world", "stop")
        prompt_tokens = len(TOKENIZER.encode("Hello world"))
        assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": prompt_tokens + 1,
                                 "total_tokens": 2 * prompt_tokens + 1}  # EOS counts, as a model's does
        status, body = await complete(client, max_tokens=1)
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["choices"][0]["text"] == TOKENIZER.decode(TOKENIZER.encode("Hello world")[:1])


async def test_chat_through_the_chatml_template() -> None:
    async with serve_scripted(installed_plugins=False, script=reply("Hi there!")) as client:
        response = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
        assert response.status == 200
        body = await response.json()
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi there!"} | {
            k: v for k, v in body["choices"][0]["message"].items() if k not in ("role", "content")}
        assert body["choices"][0]["finish_reason"] == "stop"
        prompt = scripted_engine(client).requests[-1].prompt_token_ids
        assert TOKENIZER.decode(prompt, skip_special_tokens=False) == (
            "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")


async def test_scripts_see_the_call_and_each_sequence_of_n() -> None:
    seen: list[ScriptCall] = []

    def script(call: ScriptCall) -> str:
        seen.append(call)
        return f" {call.index} of {call.prompt_text}"

    async with serve_scripted(installed_plugins=False, script=script) as client:
        status, body = await complete(client, prompt="ten", n=2, temperature=0.5)
        assert status == 200
        assert sorted(c["text"] for c in body["choices"]) == [" 0 of ten", " 1 of ten"]
        assert [c.index for c in seen] == [0, 1] and seen[0].sampling.temperature == 0.5


async def test_stop_token_ids_stop_and_are_reported() -> None:
    words = TOKENIZER.encode(" one two three four", add_special_tokens=False)
    async with serve_scripted(installed_plugins=False, script=lambda call: iter(words)) as client:
        status, body = await complete(client, stop_token_ids=[words[2]])
        choice = body["choices"][0]
        assert status == 200 and (choice["finish_reason"], choice["stop_reason"]) == ("stop", words[2])
        assert choice["text"] == TOKENIZER.decode(words[:3])  # a stop token is text, unlike EOS
        # a script that runs out ends as a model does: with EOS ("stop")
        status, body = await complete(client)
        assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == (" one two three four", "stop")


async def test_an_endless_script_is_cut_by_max_tokens_and_streams_token_by_token() -> None:
    def counter(call: ScriptCall) -> Any:
        token = TOKENIZER.token_to_id("a")
        while True:
            yield token

    async with serve_scripted(installed_plugins=False, script=counter) as client:
        response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True})
        events = [line[6:] for line in (await response.text()).splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        assert "".join(c["text"] for c in chunks) == "aaaaa" and chunks[-1]["finish_reason"] == "length"
        assert len([c for c in chunks if c["text"]]) == 5


async def test_logprobs_are_well_formed() -> None:
    async with serve_scripted(installed_plugins=False) as client:
        status, body = await complete(client, logprobs=3, echo=True, max_tokens=2)
        assert status == 200
        logprobs = body["choices"][0]["logprobs"]
        prompt_tokens = len(TOKENIZER.encode("Hello world"))
        assert len(logprobs["tokens"]) == prompt_tokens + 2
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        for lp, top in zip(logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]):
            assert lp == pytest.approx(math.log(0.5)) and len(top) == 3
            assert all(value <= 0 for value in top.values())
        assert logprobs["text_offset"] == sorted(logprobs["text_offset"])


async def test_stop_strings_abort_the_sequence_in_the_engine() -> None:
    async with serve_scripted(installed_plugins=False, script=reply(" one two three")) as client:
        status, body = await complete(client, stop=[" two"])
        assert status == 200 and body["choices"][0]["text"] == " one"
        assert body["choices"][0]["stop_reason"] == " two"
        engine = scripted_engine(client)
        assert engine.stats().running == 0  # the engine was told, and its sequence ended


class Processors:
    def __init__(self, make: Callable[[], Callable[[Sequence[int], Any], None]]) -> None:
        self.make = make

    @hookimpl
    def trtserver_logits_processors(self, request: Any, context: Any) -> list[Callable[[], Any]]:
        return [self.make]


async def test_logits_processors_steer_the_scripted_tokens() -> None:
    words = TOKENIZER.encode(" one two three", add_special_tokens=False)
    seen: list[list[int]] = []

    def ban_two(output_token_ids: Sequence[int], logits: Any) -> None:
        seen.append(list(output_token_ids))
        logits[words[1]] = float("-inf")

    async with serve_scripted([Processors(lambda: ban_two)], installed_plugins=False,
                              script=lambda call: iter(words)) as client:
        status, body = await complete(client)
        assert status == 200
        # the banned token's step emits the row's argmax instead: the lowest id, a special token
        assert body["choices"][0]["text"] == TOKENIZER.decode([words[0], *words[2:]])
        assert seen[:3] == [[], words[:1], [words[0], TOKENIZER.token_to_id("<|endoftext|>")]]


class AllowOnly:
    """A guide allowing ``tokens`` (and EOS), terminated after ``steps`` tokens."""

    def __init__(self, tokens: set[int], steps: int) -> None:
        self.tokens, self.steps, self.accepted = tokens, steps, 0

    def new_state(self) -> AllowOnly:
        return AllowOnly(self.tokens, self.steps)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        for t in self.tokens:
            bitmask[row, t // 32] |= 1 << (t % 32)

    def accept_token(self, token_id: int) -> bool:
        self.accepted += 1
        return token_id in self.tokens

    def is_terminated(self) -> bool:
        return self.accepted >= self.steps


class Guides:
    def __init__(self, guide: AllowOnly) -> None:
        self.guide = guide

    @hookimpl
    def trtserver_register_guided_backends(self, register: Any) -> None:
        register("test", lambda spec, context: self.guide)


async def test_a_guide_masks_the_row_and_ends_the_sequence() -> None:
    allowed = TOKENIZER.token_to_id("a")
    assert allowed is not None
    async with serve_scripted([Guides(AllowOnly({allowed}, steps=3))], installed_plugins=False,
                              script=reply(" anything")) as client:
        status, body = await complete(client, guided_regex="a+", guided_decoding_backend="test")
        assert status == 200
        assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == ("aaa", "stop")


async def test_beam_search_is_refused_with_a_400() -> None:
    async with serve_scripted(installed_plugins=False) as client:
        status, body = await complete(client, use_beam_search=True, n=2, temperature=0)
        assert status == 400 and body["error"]["param"] == "use_beam_search"


async def test_return_token_ids_keeps_tokens_that_make_no_text_yet() -> None:
    ids = TOKENIZER.encode(" café", add_special_tokens=False)
    assert b"\xc3" in (TOKENIZER.token_bytes or ())[ids[2]]  # é is split: its first token is no text yet
    async with serve_scripted(installed_plugins=False, script=lambda call: iter(ids)) as client:
        status, body = await complete(client, return_token_ids=True, ignore_eos=True)
        assert status == 200 and body["choices"][0]["token_ids"] == ids


async def test_min_tokens_skips_ending_tokens_and_ignore_eos_runs_to_the_script_end() -> None:
    eos = TOKENIZER.eos_token_ids[0]
    two, three = (TOKENIZER.token_to_id(word) for word in ("Ġtwo", "Ġthree"))
    assert two is not None and three is not None
    async with serve_scripted(installed_plugins=False, script=lambda call: [two, eos, three, eos]) as client:
        _, body = await complete(client)
        assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == (" two", "stop")
        _, body = await complete(client, min_tokens=2)
        assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == (" two three", "stop")
        _, body = await complete(client, ignore_eos=True)  # EOS is one more token, and no text
        assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == (" two three", "length")
        assert body["usage"]["completion_tokens"] == 4


async def test_a_client_that_goes_away_aborts_its_sequences() -> None:
    def endless(call: ScriptCall) -> Any:
        while True:
            yield TOKENIZER.token_to_id("a")

    async with serve_scripted(installed_plugins=False, script=endless, step_delay_s=0.01) as client:
        engine = scripted_engine(client)
        response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4000, "stream": True,
                                                              "n": 2})
        await response.content.readline()
        assert engine.stats().running == 2
        response.close()
        for _ in range(200):
            if engine.stats().running == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().running == 0


def test_an_engine_base_subclass_sets_info_and_tokenizer() -> None:
    """Plugin engines assign ``info`` and ``tokenizer`` as attributes."""
    from trtserver.engine.base import EngineBase, EngineInfo

    info = EngineInfo(model_name="mine", context_length=64, vocab_size=10, eos_token_ids=(0,))

    class Assigns(EngineBase):
        def __init__(self) -> None:
            self.info, self.tokenizer = info, "tokenizer"  # type: ignore[assignment]

    engine = Assigns()
    assert engine.info is info and engine.tokenizer == "tokenizer"
