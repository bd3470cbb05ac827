"""Tokens to text, in one place for every engine: incremental decoding and stop matching.

``TextStream`` keeps one choice's decoded text. The serving layer feeds it new token ids, asks
whether any stop condition matched, and takes the text that is safe to send: text that could
still turn into a stop string is held back until it either does or cannot.
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from trtserver.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class StopMatch:
    """``text[start:end]`` is the stop; ``reason`` becomes the choice's ``stop_reason``."""

    start: int
    end: int
    reason: str | int | None


@runtime_checkable
class StopChecker(Protocol):
    """A custom stop condition on one choice's generated text (see ``trtserver_stop_checkers``)."""

    def find(self, text: str, new_from: int) -> StopMatch | None:
        """The earliest match in ``text``, or None. ``text[:new_from]`` was seen by a previous call
        (a match may still begin there, since the new text may complete it)."""

    def hold(self, text: str) -> int:
        """How many trailing characters of ``text`` could still become part of a match; a stream
        withholds them until they either match or cannot."""


# longest stop string the API accepts: matching is linear in the text whatever the length, but each
# stop's table costs memory and start-up time in proportion to it
MAX_STOP_CHARS = 4096


def check_stop_strings(stops: Sequence[str], param: str = "stop") -> None:
    """Refuse (400) a stop string longer than ``MAX_STOP_CHARS``."""
    from trtserver.errors import InvalidRequest

    for stop in stops:
        if len(stop) > MAX_STOP_CHARS:
            raise InvalidRequest(f"a stop string may be at most {MAX_STOP_CHARS} characters, got {len(stop)}",
                                 param=param)


@functools.lru_cache(maxsize=512)
def _failure_table(stop: str) -> tuple[int, ...]:
    """KMP: for each prefix of ``stop``, the length of its longest proper border."""
    table = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return tuple(table)


class StopStrings:
    """The request's ``stop`` list as a StopChecker.

    One KMP automaton per stop string follows the text as it grows: its state is the longest
    suffix of the text that is a prefix of that stop, so each new character costs amortised
    constant work per stop, and the hold-back is the largest state.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._tables = [_failure_table(s) for s in self.stops]
        self._states = [0] * len(self.stops)
        self._text = ""  # the text fed to the automata so far
        self._seen = 0
        self._match: StopMatch | None = None

    def _advance(self, text: str) -> None:
        if text is not self._text and not text.startswith(self._text):  # another text: start again
            self._states = [0] * len(self.stops)
            self._seen = 0
            self._match = None
        self._text = text
        if self._match is not None or self._seen == len(text):
            return
        best: StopMatch | None = None
        for n, (stop, table) in enumerate(zip(self.stops, self._tables)):
            q = self._states[n]
            size = len(stop)
            for i in range(self._seen, len(text)):
                c = text[i]
                while q and stop[q] != c:
                    q = table[q - 1]
                if stop[q] == c:
                    q += 1
                    if q == size:
                        start = i + 1 - size
                        if best is None or start < best.start:
                            best = StopMatch(start, i + 1, stop)
                        q = table[q - 1]
                        break
            self._states[n] = q
        self._seen = len(text)
        self._match = best

    def find(self, text: str, new_from: int) -> StopMatch | None:
        self._advance(text)
        return self._match

    def hold(self, text: str) -> int:
        # the longest suffix of text that is a proper prefix of some stop string
        self._advance(text)
        return max(self._states, default=0)


class IncrementalDecoder:
    """Token ids to text, correct for characters split across tokens.

    For byte-level tokenizers (``Tokenizer.token_bytes``) it decodes each token's bytes as UTF-8
    as they come; for the others it wraps tokenizers' ``DecodeStream``. With
    ``spaces_between_special_tokens`` (and special tokens kept) it puts a space between a special
    token and its neighbours, as Hugging Face's slow tokenizers and vLLM do.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, byte_table: bool = True) -> None:
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend
        self._skip = skip_special_tokens
        self._space_specials = spaces_between_special_tokens and not skip_special_tokens
        self._specials = tokenizer.special_token_ids
        self._bytes = tokenizer.token_bytes if byte_table else None
        self._stream = tokenizer.decode_stream(skip_special_tokens=skip_special_tokens) if self._bytes is None else None
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._produced = False
        self._after_special = False
        self._run: list[int] = []  # DecodeStream only: ids since the last special token, and their text's length
        self._run_chars = 0

    def step(self, token_id: int) -> str:
        if token_id in self._specials:
            if self._skip:
                return ""
            piece = self._tokenizer.id_to_token(token_id) or ""
            # a special token ends the bytes before it: a dangling one is U+FFFD, as in a whole decode
            dangling = self._utf8.decode(b"", final=True) if self._bytes is not None else self._run_rest()
            if dangling and self._after_special and self._space_specials:
                dangling = " " + dangling
            # and resets the byte-level state: start afresh after it
            if self._stream is not None:
                self._stream = self._tokenizer.decode_stream(skip_special_tokens=self._skip)
            self._utf8.reset()
            if self._space_specials and (self._produced or dangling):
                piece = " " + piece
            self._produced = True
            self._after_special = True
            return dangling + piece
        table = self._bytes
        if table is not None:
            piece = self._utf8.decode(table[token_id]) if 0 <= token_id < len(table) else ""
        else:
            assert self._stream is not None
            try:
                piece = self._stream.step(self._backend, token_id) or ""
            except Exception:  # ids the tokenizer does not know decode to nothing, never crash
                piece = ""
            else:
                if not self._skip:
                    self._run.append(token_id)
                    self._run_chars += len(piece)
        if piece:
            if self._after_special and self._space_specials:
                piece = " " + piece
            self._after_special = False
            self._produced = True
        return piece

    def _run_rest(self) -> str:
        """What DecodeStream still holds of the ids since the last special token (it has no flush)."""
        rest = self._tokenizer.decode(self._run, skip_special_tokens=False)[self._run_chars:] if self._run else ""
        self._run, self._run_chars = [], 0
        return rest

    def feed(self, token_ids: Sequence[int]) -> str:
        if len(token_ids) == 1:  # one token a step: the usual case
            return self.step(token_ids[0])
        return "".join(self.step(t) for t in token_ids)


class TextStream:
    """One choice's text: decoding, stop detection, and what may be sent so far."""

    def __init__(self, decoder: IncrementalDecoder, checkers: Sequence[StopChecker] = (),
                 *, include_stop_str_in_output: bool = False) -> None:
        self._decoder = decoder
        self._checkers = tuple(checkers)
        self._include_stop = include_stop_str_in_output
        self.text = ""
        self.sent = 0
        self.stop: StopMatch | None = None

    def add(self, token_ids: Sequence[int]) -> StopMatch | None:
        """Decode new tokens; return the stop that matched, if one did (text is then final)."""
        if self.stop is not None:
            return self.stop
        new_from = len(self.text)
        self.text += self._decoder.feed(token_ids)
        if not self._checkers or len(self.text) == new_from:
            return None
        best: StopMatch | None = None
        for checker in self._checkers:
            match = checker.find(self.text, new_from)
            if match is not None and (best is None or match.start < best.start):
                best = match
        if best is not None:
            self.stop = best
            self.text = self.text[: best.end if self._include_stop else best.start]
        return best

    def take(self, *, final: bool) -> str:
        """The text not yet sent, minus what must still be held back (nothing when final)."""
        end = len(self.text)
        if not final and self.stop is None and self._checkers:
            end -= max(checker.hold(self.text) for checker in self._checkers)
        if end <= self.sent:
            return ""
        piece = self.text[self.sent : end]
        self.sent = end
        return piece
