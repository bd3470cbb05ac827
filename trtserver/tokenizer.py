"""The model's tokenizer, from an engine directory's ``tokenizer.json`` (Hugging Face tokenizers)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cached_property, lru_cache
from pathlib import Path

import tokenizers
from tokenizers.decoders import ByteLevel, DecodeStream

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

FIM_TOKEN_SETS = (
    # (prefix, suffix, middle): StarCoder / SantaCoder family, then CodeLlama / Qwen2.5-coder style
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<PRE>", "<SUF>", "<MID>"),
)


class Tokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_ids: tuple[int, ...], add_bos_token: bool,
                 special_tokens: Mapping[str, str] | None = None) -> None:
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos_token = add_bos_token
        self.special_tokens = dict(special_tokens or {})
        """``{"bos_token": "<s>", "eos_token": ...}`` as tokenizer_config.json names them (chat templates use them)."""
        if "bos_token" not in self.special_tokens and bos_token_id is not None:
            bos_text = tokenizer.id_to_token(bos_token_id)
            if bos_text is not None:
                self.special_tokens["bos_token"] = str(bos_text)
        # tokenizer.json's post-processor may add BOS itself; we add it here instead so
        # add_special_tokens has one meaning whatever the file says
        self._tok.post_processor = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        model_config = _read_json(path / "config.json")

        def token_text(name: str) -> str | None:
            value = config.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            return value if isinstance(value, str) else None

        def token_id(name: str) -> int | None:
            text = token_text(name)
            return None if text is None else tok.token_to_id(text)

        bos = token_id("bos_token")
        if bos is None:
            bos = model_config.get("bos_token_id")
        eos: list[int] = []
        for source in (generation.get("eos_token_id"), model_config.get("eos_token_id"), token_id("eos_token")):
            for value in source if isinstance(source, list) else [source]:
                if isinstance(value, int) and value not in eos:
                    eos.append(value)
        special = {name: text for name in SPECIAL_TOKEN_NAMES if (text := token_text(name)) is not None}
        return cls(tok, bos_token_id=bos, eos_token_ids=tuple(eos),
                   add_bos_token=bool(config.get("add_bos_token", False)), special_tokens=special)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(
            token_id for token_id, added in self._tok.get_added_tokens_decoder().items() if added.special
        )

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    @cached_property
    def token_bytes(self) -> tuple[bytes, ...] | None:
        """Every token's bytes, where the decoder is GPT-2's byte-level one: a token then always
        stands for the same bytes, and streamed text is just their UTF-8 decoding (``IncrementalDecoder``
        does that itself, a dict lookup where tokenizers' ``DecodeStream`` re-decodes a window of
        tokens). None for any other decoder."""
        if not isinstance(self._tok.decoder, ByteLevel):
            return None
        to_byte = byte_level_to_bytes()
        added = self._tok.get_added_tokens_decoder()
        table = []
        for token_id in range(self.vocab_size):
            if token_id in added:
                table.append(added[token_id].content.encode())
                continue
            token = self._tok.id_to_token(token_id) or ""
            try:
                table.append(bytes(to_byte[char] for char in token))
            except KeyError:  # a token outside the byte alphabet: not plain byte-level after all
                return None
        return tuple(table)

    def decode_stream(self, *, skip_special_tokens: bool = True) -> DecodeStream:
        return DecodeStream(skip_special_tokens=skip_special_tokens)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    def token_to_id(self, token: str) -> int | None:
        value = self._tok.token_to_id(token)
        return None if value is None else int(value)

    def id_to_token(self, token_id: int) -> str | None:
        value = self._tok.id_to_token(token_id)
        return None if value is None else str(value)

    @cached_property
    def fim_token_ids(self) -> tuple[int, int, int] | None:
        """(prefix, suffix, middle) ids when the vocabulary has fill-in-the-middle tokens."""
        for names in FIM_TOKEN_SETS:
            ids = [self.token_to_id(name) for name in names]
            if all(i is not None for i in ids):
                return (ids[0], ids[1], ids[2])  # type: ignore[return-value]
        return None


@lru_cache(maxsize=1)
def byte_level_to_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the byte each character stands for (printable bytes
    stand for themselves; the others are shifted past 255, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(byte): byte for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in table.values():
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


def _read_json(path: Path) -> dict:  # type: ignore[type-arg]
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}
