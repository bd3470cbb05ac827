"""The byte-exact vocabulary and the bitmask helpers."""

from __future__ import annotations

import numpy as np
import pytest
from trtserver.guided import GuideContext
from trtserver.tokenizer import Tokenizer

from trtserver_guided.backend import strip_anchors
from trtserver_guided.vocab import ids_to_words, vocab_for, words_to_ids


@pytest.mark.parametrize("text", ["日本語 👍 龘", "héllo wörld\n\tΩ", "emoji 🧑‍🚀 and ﬁ ligature", " Ġ literal"])
def test_token_bytes_are_exact(tokenizer: Tokenizer, context: GuideContext, text: str) -> None:
    vocab = vocab_for(context)
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [vocab.token_bytes[i] for i in ids]
    assert all(p is not None for p in pieces)
    assert b"".join(p for p in pieces if p is not None) == text.encode("utf-8")
    # and at least one token of the CJK/emoji strings is a partial UTF-8 sequence
    if "龘" in text:
        assert any(_partial(p) for p in pieces if p is not None)


def _partial(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_special_and_padding_excluded(tokenizer: Tokenizer, context: GuideContext) -> None:
    vocab = vocab_for(context)
    assert len(vocab.token_bytes) == context.vocab_size
    for tid in tokenizer.special_token_ids | set(context.eos_token_ids):
        assert vocab.token_bytes[tid] is None
    assert all(b is None for b in vocab.token_bytes[tokenizer.vocab_size:])
    alphabet = words_to_ids(vocab.allowed_alphabet_mask(), context.vocab_size)
    assert not set(alphabet.tolist()) & (tokenizer.special_token_ids | set(context.eos_token_ids))
    assert alphabet.max() < tokenizer.vocab_size
    assert vocab_for(context) is vocab  # cached


def test_bitmask_roundtrip() -> None:
    ids = [0, 1, 31, 32, 33, 63, 64, 1000, 49151]
    words = ids_to_words(ids, 49152 + 5)
    assert words.dtype == np.int32 and words.shape == ((49152 + 5 + 31) // 32,)
    assert words[0] == (1 | 2 | (1 << 31)) - (1 << 32)  # bit 31 is the int32 sign bit
    assert words_to_ids(words, 49152 + 5).tolist() == ids


def test_strip_anchors() -> None:
    assert strip_anchors(r"^\d+$") == r"\d+"
    assert strip_anchors(r"a\$") == r"a\$"
    assert strip_anchors(r"\Aab\z") == "ab"
