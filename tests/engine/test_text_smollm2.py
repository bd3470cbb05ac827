"""Streamed text from the real model's vocabulary (49k byte-level tokens): the checks tests/unit/test_text.py
runs on a small synthetic one."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from trtserver.text import IncrementalDecoder
from trtserver.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(smol_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smol_dir)


def test_incremental_decoding_handles_split_multibyte_characters(tokenizer: Tokenizer) -> None:
    text = "Héllo wörld 🎉 — naïve 日本語"
    ids = tokenizer.encode(text)
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.step(t) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # some tokens hold half a character


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
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(40)] + [1, 72, 2]
        for skip in (True, False):
            table = IncrementalDecoder(tokenizer, skip_special_tokens=skip)
            stream = IncrementalDecoder(tokenizer, skip_special_tokens=skip, byte_table=False)
            assert "".join(table.step(t) for t in ids) == "".join(stream.step(t) for t in ids)
