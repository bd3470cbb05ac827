"""vLLM's ``bad_words``: never generate these words (as the prompt would tokenize them, with and
without a leading space). A word's last token is banned whenever the tokens before it were just
generated; a one-token word is banned outright."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from trtserver.engine.base import LogitsProcessor
from trtserver.tokenizer import Tokenizer


class BadWordsProcessor:
    def __init__(self, sequences: Sequence[tuple[int, ...]]) -> None:
        self._single = sorted({seq[0] for seq in sequences if len(seq) == 1})
        self._multi = [seq for seq in sequences if len(seq) > 1]

    def __call__(self, output_token_ids: Sequence[int], logits: object) -> None:
        row = logits  # a 1-D tensor; typed loosely so this module imports no torch
        if self._single:
            row[self._single] = float("-inf")  # type: ignore[index]
        for seq in self._multi:
            prefix = seq[:-1]
            if len(output_token_ids) >= len(prefix) and tuple(output_token_ids[-len(prefix):]) == prefix:
                row[seq[-1]] = float("-inf")  # type: ignore[index]


def bad_words_factory(words: Sequence[str], tokenizer: Tokenizer) -> Callable[[], LogitsProcessor]:
    sequences: set[tuple[int, ...]] = set()
    for word in words:
        for variant in (word, " " + word.lstrip(" ")):
            ids = tuple(tokenizer.encode(variant, add_special_tokens=False))
            if ids:
                sequences.add(ids)
    frozen = sorted(sequences)
    return lambda: BadWordsProcessor(frozen)
