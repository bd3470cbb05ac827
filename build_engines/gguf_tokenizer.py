"""GGUF tokenizer metadata -> ``tokenizer.json`` (Hugging Face tokenizers) and its config files.

Only byte-level BPE (``tokenizer.ggml.model == "gpt2"``) is supported. The pre-tokenizer follows
llama.cpp's ``tokenizer.ggml.pre`` (``src/llama-vocab.cpp``): "smollm", "starcoder", "refact" and
"codeshell" split every digit on its own (``\\p{N}``) before the GPT-2 regex, which is what the
original HF tokenizers do with ``Digits(individual_digits=True)`` + ``ByteLevel(use_regex=True)``;
"gpt2" / "default" is the GPT-2 regex alone.
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)

from build_engines.gguf_convert import GgufConvertError, field

DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "codeshell"})
PLAIN_BYTELEVEL_PRE = frozenset({"gpt2", "default"})
# tokenizer.ggml.token_type values (llama.cpp LLAMA_TOKEN_TYPE_*)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


def build_tokenizer(reader: GGUFReader) -> Tokenizer:
    model = field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise GgufConvertError(
            f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2')"
        )
    pre = field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in DIGIT_SPLIT_PRE:
        pre_tokenizer: Any = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in PLAIN_BYTELEVEL_PRE:
        pre_tokenizer = byte_level
    else:
        raise GgufConvertError(
            f"GGUF pre-tokenizer {pre!r} is not supported "
            f"(supported: {sorted(DIGIT_SPLIT_PRE | PLAIN_BYTELEVEL_PRE)})"
        )

    tokens: list[str] = list(field(reader, "tokenizer.ggml.tokens"))
    types: list[int] = list(field(reader, "tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GgufConvertError("GGUF vocabulary has duplicate tokens")

    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False)
    )
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [
        AddedToken(tokens[i], special=types[i] == TOKEN_CONTROL, normalized=False)
        for i in range(len(tokens))
        if types[i] in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
    ]
    tok.add_tokens(added)  # already in the vocabulary: they keep their ids
    return tok


def _token(reader: GGUFReader, key: str) -> str | None:
    token_id = field(reader, f"tokenizer.ggml.{key}")
    tokens = reader.fields["tokenizer.ggml.tokens"]
    if token_id is None or not 0 <= int(token_id) < len(tokens.data):
        return None
    return str(tokens.contents(int(token_id)))


def tokenizer_config(reader: GGUFReader, context_length: int) -> dict[str, Any]:
    """``tokenizer_config.json``: special tokens, BOS policy, chat template, max length."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(field(reader, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(field(reader, "tokenizer.ggml.add_space_prefix", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        token = _token(reader, key)
        if token is not None:
            config[name] = token
    template = field(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def generation_config(reader: GGUFReader) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for name, key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        value = field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            config[name] = int(value)
    return config
