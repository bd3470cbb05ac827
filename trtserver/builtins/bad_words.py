"""vLLM's ``bad_words``: never generate these words (as the prompt would tokenize them, with and
without a leading space). A word's last token is banned whenever the tokens before it were just
generated; a one-token word is banned outright. A built-in plugin on the public hook."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from trtserver.engine.base import LogitsProcessor
from trtserver.hookspecs import hookimpl
from trtserver.tokenizer import Tokenizer

if TYPE_CHECKING:
    from trtserver.protocol import ChatCompletionRequest, CompletionRequest
    from trtserver.request_context import RequestContext


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


@hookimpl
def trtserver_logits_processors(request: CompletionRequest | ChatCompletionRequest, context: RequestContext,
                                tokenizer: Tokenizer) -> list[Callable[[], LogitsProcessor]] | None:
    return [bad_words_factory(request.bad_words, tokenizer)] if request.bad_words else None
