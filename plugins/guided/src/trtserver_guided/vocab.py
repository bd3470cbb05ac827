"""Byte-exact view of the model's vocabulary, shared by every backend.

Each token id maps to the exact bytes it decodes to (GPT-2 byte-level BPE: invert
``bytes_to_unicode``; SentencePiece-style: ``<0xXX>`` byte-fallback pieces and ``▁`` = space),
or to None for special tokens, which are never part of a grammar's alphabet (EOS is allowed
only by the backends' stop handling). Ids from the tokenizer's size up to the logits width are
padding and are never allowed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from trtserver.tokenizer import byte_level_to_bytes

if TYPE_CHECKING:
    from trtserver.guided import GuideContext

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _decoder_kind(tokenizer_json: dict[str, Any]) -> str:
    """'byte_level', 'sentencepiece' or 'other', from tokenizer.json's decoder section."""

    def kinds(node: Any) -> list[str]:
        if not isinstance(node, dict):
            return []
        found = [str(node.get("type"))]
        for child in node.get("decoders") or []:
            found.extend(kinds(child))
        return found

    decoder_types = kinds(tokenizer_json.get("decoder"))
    if "ByteLevel" in decoder_types:
        return "byte_level"
    if "ByteFallback" in decoder_types or "Metaspace" in decoder_types or "Replace" in decoder_types:
        return "sentencepiece"
    return "other"


@dataclass(slots=True)
class Vocab:
    """Token bytes for ids ``0 .. vocab_size-1`` (None = special or padding) and the stop ids."""

    token_bytes: list[bytes | None]
    vocab_size: int  # logits width
    tokenizer_size: int  # ids >= this are padding
    eos_token_ids: tuple[int, ...]
    special_token_ids: frozenset[int]
    kind: str
    tokenizer_json: str = field(repr=False, default="")

    @property
    def words(self) -> int:
        return (self.vocab_size + 31) // 32

    def stop_mask(self) -> np.ndarray:
        """int32 words with the EOS bits set."""
        return ids_to_words(list(self.eos_token_ids), self.vocab_size)

    def allowed_alphabet_mask(self) -> np.ndarray:
        """int32 words with every non-special, non-padding token set (EOS excluded)."""
        ids = [i for i, b in enumerate(self.token_bytes) if b is not None]
        return ids_to_words(ids, self.vocab_size)


def ids_to_words(ids: list[int] | np.ndarray, vocab_size: int) -> np.ndarray:
    """Allowed ids -> int32 bitmask words (bit ``t % 32`` of word ``t // 32``), vectorised."""
    words = (vocab_size + 31) // 32
    bits = np.zeros(words * 32, dtype=np.bool_)
    arr = np.asarray(ids, dtype=np.int64)
    if arr.size:
        arr = arr[(arr >= 0) & (arr < vocab_size)]
        bits[arr] = True
    return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32, copy=False)


def words_to_ids(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """Inverse of ``ids_to_words``: the allowed ids, ascending."""
    bits = np.unpackbits(np.ascontiguousarray(words, dtype="<i4").view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


def build_vocab(tokenizer_backend: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                special_token_ids: frozenset[int]) -> Vocab:
    """Build the byte-exact vocabulary from a ``tokenizers.Tokenizer``."""
    tj_text: str = tokenizer_backend.to_str()
    tj = json.loads(tj_text)
    kind = _decoder_kind(tj)
    added = tokenizer_backend.get_added_tokens_decoder()
    size = int(tokenizer_backend.get_vocab_size(with_added_tokens=True))
    u2b = byte_level_to_bytes()
    out: list[bytes | None] = [None] * vocab_size
    special = frozenset(special_token_ids) | frozenset(i for i, tok in added.items() if tok.special)
    for tid in range(min(size, vocab_size)):
        if tid in special or tid in eos_token_ids:
            continue
        piece = tokenizer_backend.id_to_token(tid)
        if piece is None:
            continue
        if tid in added:  # a non-special added token: its content is plain text
            out[tid] = added[tid].content.encode("utf-8")
        elif kind == "byte_level":
            try:
                out[tid] = bytes(u2b[c] for c in piece)
            except KeyError:  # not in the byte alphabet: literal text
                out[tid] = piece.encode("utf-8")
        elif kind == "sentencepiece":
            m = _BYTE_PIECE.match(piece)
            out[tid] = bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode("utf-8")
        else:
            out[tid] = tokenizer_backend.decode([tid], skip_special_tokens=False).encode("utf-8")
        if out[tid] == b"":
            out[tid] = None
    return Vocab(out, vocab_size, size, tuple(eos_token_ids), special, kind, tj_text)


_VOCABS: dict[tuple[int, int, tuple[int, ...]], tuple[object, Vocab]] = {}


def vocab_for(context: GuideContext) -> Vocab:
    """The (cached) vocabulary for a guide context's tokenizer and logits width."""
    backend = context.tokenizer.backend
    key = (id(backend), context.vocab_size, tuple(context.eos_token_ids))
    hit = _VOCABS.get(key)
    if hit is not None and hit[0] is backend:
        return hit[1]
    vocab = build_vocab(backend, context.vocab_size, tuple(context.eos_token_ids),
                        frozenset(context.tokenizer.special_token_ids))
    _VOCABS[key] = (backend, vocab)  # the tokenizer is kept alive, so its id is not reused
    return vocab
