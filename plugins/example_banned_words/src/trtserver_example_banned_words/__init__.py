"""Banned words: a small, complete trtserver plugin to copy.

Settings, in the server's TOML file (validated at start-up, so a bad table stops the server)::

    [plugins.banned_words]
    words = ["dragons", "lava"]

Then:

* ``trtserver_request_received``: a prompt containing a banned word (any case, whole word) is
  rejected with a 400 naming ``prompt``;
* ``trtserver_logits_processors``: the model can never generate a banned word in its common
  spellings (``word``, `` word``, ``Word``, `` Word``): every token sequence that spells one is
  blocked by setting the logit of its last token to ``-inf`` when the tokens before it were just
  generated (single-token words are blocked always).

With no words configured the plugin does nothing.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from trtserver import hookimpl
from trtserver.errors import InvalidRequest
from trtserver.plugins import plugin_settings
from trtserver.protocol import ChatCompletionRequest

if TYPE_CHECKING:
    from trtserver.config import ServerConfig
    from trtserver.protocol import CompletionRequest
    from trtserver.request_context import RequestContext
    from trtserver.tokenizer import Tokenizer

__version__ = "0.1.0"

NAME = "banned_words"  # the entry point's name, and so the settings table's


class Settings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    words: list[str] = []


def banned_words(config: ServerConfig) -> tuple[str, ...]:
    """The ``[plugins.banned_words]`` table's words, blanks dropped."""
    return tuple(w.strip() for w in plugin_settings(config, NAME, Settings).words if w.strip())


@functools.lru_cache(maxsize=64)
def banned_sequences(tokenizer: Tokenizer, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    spellings = {s for w in words for s in (w, " " + w, w.capitalize(), " " + w.capitalize())}
    return tuple(sorted({tuple(tokenizer.encode(s, add_special_tokens=False)) for s in spellings}))


class BanSequences:
    """A ``LogitsProcessor``: forbids the token that would complete any banned sequence."""

    def __init__(self, sequences: tuple[tuple[int, ...], ...]) -> None:
        self.sequences = sequences

    def __call__(self, output_token_ids: Sequence[int], logits: Any) -> None:
        for sequence in self.sequences:
            *prefix, last = sequence
            if not prefix or list(output_token_ids[-len(prefix):]) == prefix:
                logits[last] = float("-inf")


def _prompt_texts(prompt: object) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list):
        return [p for p in prompt if isinstance(p, str)]
    return []  # token ids: nothing to read


@hookimpl
def trtserver_app_created(config: ServerConfig) -> None:
    banned_words(config)  # a bad table stops start-up, naming the plugin and the setting


@hookimpl
def trtserver_request_received(request: CompletionRequest | ChatCompletionRequest, context: RequestContext) -> None:
    words = banned_words(context.config)
    if not words:
        return
    pattern = re.compile(r"\b(" + "|".join(re.escape(w) for w in words) + r")\b", re.IGNORECASE)
    if isinstance(request, ChatCompletionRequest):
        texts, param = [m.text() or "" for m in request.messages], "messages"
    else:
        texts, param = _prompt_texts(request.prompt), "prompt"
    for text in texts:
        found = pattern.search(text)
        if found is not None:
            raise InvalidRequest(f"the prompt contains a banned word: {found.group(0)!r}", param=param)


@hookimpl
def trtserver_logits_processors(request: CompletionRequest, context: RequestContext,
                                tokenizer: Tokenizer) -> list[Callable[[], BanSequences]] | None:
    words = banned_words(context.config)
    if not words:
        return None
    sequences = banned_sequences(tokenizer, words)
    return [lambda: BanSequences(sequences)]
