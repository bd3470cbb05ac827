from __future__ import annotations

import random

import pytest
import tokenizers

from trtserver.scripted_engine import scripted_tokenizer
from trtserver.text import IncrementalDecoder, StopStrings, TextStream
from trtserver.tokenizer import Tokenizer, byte_level_to_bytes


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """A small byte-level BPE (tests/engine/test_text_smollm2.py runs the same checks on the real model's)."""
    return scripted_tokenizer()


def test_incremental_decoding_handles_split_multibyte_characters(tokenizer: Tokenizer) -> None:
    text = "Héllo wörld 🎉 — naïve 日本語"
    ids = tokenizer.encode(text)
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.step(t) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # some tokens hold half a character


def test_gpt2_byte_alphabet() -> None:
    table = byte_level_to_bytes()
    assert len(table) == 256 and sorted(table.values()) == list(range(256))
    assert table["Ġ"] == 0x20 and table["Ċ"] == 0x0A and table["!"] == 0x21


def test_token_bytes_are_what_the_tokenizer_decodes(tokenizer: Tokenizer) -> None:
    table = tokenizer.token_bytes
    assert table is not None and len(table) == tokenizer.vocab_size
    partial = 0
    for token_id, raw in enumerate(table):
        decoded = tokenizer.decode([token_id], skip_special_tokens=False)
        try:
            assert raw.decode() == decoded, token_id
        except UnicodeDecodeError:  # half a character: the tokenizer shows a replacement character
            partial += 1
            assert "\ufffd" in decoded, token_id
    assert partial > 100  # the table was really exercised on split characters


def test_byte_table_streams_the_text_decode_stream_does(tokenizer: Tokenizer) -> None:
    """Random ids (split and invalid UTF-8, special tokens) give the same text both ways; a piece may
    come a token sooner from the table (it sends the valid bytes before a dangling lead byte)."""
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(40)] + [1, 72, 2]
        for skip in (True, False):
            table = IncrementalDecoder(tokenizer, skip_special_tokens=skip)
            stream = IncrementalDecoder(tokenizer, skip_special_tokens=skip, byte_table=False)
            assert "".join(table.step(t) for t in ids) == "".join(stream.step(t) for t in ids)


@pytest.mark.parametrize("byte_table", [True, False])
def test_bytes_left_dangling_by_a_special_token_are_shown_as_a_whole_decode_shows_them(
        tokenizer: Tokenizer, byte_table: bool) -> None:
    table = tokenizer.token_bytes or ()
    lead, continuation = (table.index(bytes([byte])) for byte in (0xC3, 0xA9))  # é is C3 A9
    start = tokenizer.token_to_id("<|im_start|>")
    assert start is not None
    for ids in ([lead, start], [continuation, start], [lead, start, continuation, start]):
        whole = tokenizer.decode(ids, skip_special_tokens=False)
        decoder = IncrementalDecoder(tokenizer, skip_special_tokens=False, spaces_between_special_tokens=False,
                                     byte_table=byte_table)
        assert decoder.feed(ids) == whole and "\ufffd" in whole


def test_other_decoders_have_no_byte_table() -> None:
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={"a": 0, "▁b": 1}, merges=[]))
    backend.decoder = tokenizers.decoders.Metaspace()
    tok = Tokenizer(backend, bos_token_id=None, eos_token_ids=(), add_bos_token=False)
    assert tok.token_bytes is None
    assert IncrementalDecoder(tok).feed([1, 0]) == "ba"


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


def _naive_hold(stops: list[str], text: str) -> int:
    longest = max(len(s) for s in stops)
    for size in range(min(longest - 1, len(text)), 0, -1):
        if any(s.startswith(text[-size:]) for s in stops):
            return size
    return 0


def test_stop_strings_agree_with_the_definition_when_fed_piece_by_piece() -> None:
    """Random stops and texts over a small alphabet, fed in random pieces: the first match (earliest
    start, then list order) and the hold-back are exactly what a full rescan gives."""
    rng = random.Random(7)
    for _ in range(300):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        full = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        checker = StopStrings(stops)
        text = ""
        while len(text) < len(full):
            new_from = len(text)
            text = full[: new_from + rng.randint(1, 4)]
            found = checker.find(text, new_from)
            hits = [(text.find(s), i) for i, s in enumerate(stops) if s in text]
            if hits:
                start, i = min(hits)
                assert found is not None and (found.start, found.end, found.reason) == (
                    start, start + len(stops[i]), stops[i]), (stops, text)
                break
            assert found is None, (stops, text)
            assert checker.hold(text) == _naive_hold(stops, text), (stops, text)


def test_stop_string_work_per_token_is_bounded() -> None:
    """A stop far longer than the text, and text that never starts it: each token costs the same."""
    import time

    checker = StopStrings(["Z" * 300_000, "abZ"])
    text = ""
    start = time.perf_counter()
    for _ in range(3000):
        new_from = len(text)
        text += "ab"
        assert checker.find(text, new_from) is None
        assert checker.hold(text) == 2
    assert time.perf_counter() - start < 1.5


def test_stop_string_limits_are_exposed() -> None:
    from trtserver.errors import InvalidRequest
    from trtserver.text import MAX_STOP_CHARS, check_stop_strings

    check_stop_strings(["x" * MAX_STOP_CHARS])
    with pytest.raises(InvalidRequest) as info:
        check_stop_strings(["ok", "x" * (MAX_STOP_CHARS + 1)])
    assert info.value.param == "stop"
