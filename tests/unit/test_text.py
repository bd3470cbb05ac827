from __future__ import annotations

from pathlib import Path

import pytest

from trtserver.text import IncrementalDecoder, StopStrings, TextStream
from trtserver.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(engine_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(engine_dir)


def test_incremental_decoding_handles_split_multibyte_characters(tokenizer: Tokenizer) -> None:
    text = "Héllo wörld 🎉 — naïve 日本語"
    ids = tokenizer.encode(text)
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.step(t) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # some tokens hold half a character


def test_special_tokens_skipped_or_spaced(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hi") + [1]
    assert IncrementalDecoder(tokenizer).feed(ids) == "Hi"
    spaced = IncrementalDecoder(tokenizer, skip_special_tokens=False).feed(ids)
    assert spaced == "Hi <|im_start|>"
    tight = IncrementalDecoder(tokenizer, skip_special_tokens=False, spaces_between_special_tokens=False).feed(ids)
    assert tight == "Hi<|im_start|>"


def test_stop_strings_earliest_match_wins() -> None:
    stops = StopStrings(["world", "lo w"])
    match = stops.find("hello world", 0)
    assert match is not None and match.reason == "lo w" and match.start == 3


def test_hold_back_only_what_could_become_a_stop() -> None:
    stops = StopStrings(["STOP"])
    assert stops.hold("abc ST") == 2
    assert stops.hold("abc S") == 1
    assert stops.hold("abc X") == 0


def test_stream_never_sends_a_partial_stop(tokenizer: Tokenizer) -> None:
    stream = TextStream(IncrementalDecoder(tokenizer), [StopStrings([" world"])])
    sent = []
    for token in tokenizer.encode("hello world and more"):
        match = stream.add([token])
        sent.append(stream.take(final=match is not None))
        if match:
            break
    assert "".join(sent) == "hello"
    assert stream.stop is not None and stream.stop.reason == " world"


def test_include_stop_str_in_output(tokenizer: Tokenizer) -> None:
    stream = TextStream(IncrementalDecoder(tokenizer), [StopStrings(["b"])], include_stop_str_in_output=True)
    stream.add(tokenizer.encode("a b c"))
    assert stream.text == "a b"
