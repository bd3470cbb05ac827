"""Custom stop conditions, as request fields trtserver itself does not know.

``stop_regex`` (a pattern or a list of up to ``MAX_PATTERNS`` patterns, Python ``regex`` syntax):
generation stops at the earliest match in the generated text; the match is cut off like a stop
string (kept with ``include_stop_str_in_output``) and ``stop_reason`` is the pattern that matched.
A pattern that does not compile or that matches the empty string is a 400 naming ``stop_regex``.

Streams never send text that could still become part of a match. ``hold`` uses the ``regex``
module's partial matching: ``search(text, partial=True)`` finds the earliest position where a
match either completes or runs into the end of the text; everything from there on is withheld
until more text decides it. Because the text is only ever appended to, a match that would start
before that position is impossible, so what was sent can never turn out to contain a match.
Matches are decided on the text generated so far (``a+`` stops at the first ``a``; ``x$`` matches
whenever the text so far ends in ``x``), identically for streamed and non-streamed requests.

``stop_after_lines: N`` (an integer >= 1): stop once N newline-terminated lines were generated; the
text ends with the N-th newline and ``stop_reason`` is ``"lines:N"``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import regex

from trtserver import hookimpl
from trtserver.errors import InvalidRequest
from trtserver.text import StopMatch

if TYPE_CHECKING:
    from trtserver.protocol import CompletionRequest
    from trtserver.request_context import RequestContext
    from trtserver.text import StopChecker

__version__ = "0.1.0"

MAX_PATTERNS = 16
MAX_PATTERN_LENGTH = 1000


class RegexStop:
    """Stop at the earliest match of any of ``patterns``."""

    def __init__(self, patterns: tuple[regex.Pattern[str], ...]) -> None:
        self.patterns = patterns

    def find(self, text: str, new_from: int) -> StopMatch | None:
        # a match may begin anywhere in the held-back tail, so search the whole text (short: it is
        # one choice's completion) - the same call whether or not the request streams
        best: StopMatch | None = None
        for pattern in self.patterns:
            match = pattern.search(text)
            if match is not None and (best is None or match.start() < best.start):
                best = StopMatch(match.start(), match.end(), pattern.pattern)
        return best

    def hold(self, text: str) -> int:
        earliest = len(text)
        for pattern in self.patterns:
            match = pattern.search(text, partial=True)
            if match is not None:
                earliest = min(earliest, match.start())
        return len(text) - earliest


class LineStop:
    """Stop after ``lines`` newline-terminated lines; the text keeps the last newline."""

    def __init__(self, lines: int) -> None:
        self.lines = lines

    def find(self, text: str, new_from: int) -> StopMatch | None:
        at = -1
        for _ in range(self.lines):
            at = text.find("\n", at + 1)
            if at < 0:
                return None
        return StopMatch(at + 1, at + 1, f"lines:{self.lines}")

    def hold(self, text: str) -> int:
        return 0  # a counted newline never un-happens: nothing to withhold


@functools.lru_cache(maxsize=256)
def compile_pattern(pattern: str) -> regex.Pattern[str]:
    try:
        compiled = regex.compile(pattern)
    except (regex.error, ValueError, OverflowError) as exc:
        raise InvalidRequest(f"stop_regex {pattern!r} is not a valid regular expression: {exc}",
                             param="stop_regex") from exc
    if compiled.fullmatch("") is not None:
        raise InvalidRequest(f"stop_regex {pattern!r} matches the empty string", param="stop_regex")
    return compiled


def parse_stop_regex(value: Any) -> tuple[regex.Pattern[str], ...]:
    patterns = [value] if isinstance(value, str) else value
    if not isinstance(patterns, list) or not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise InvalidRequest("stop_regex must be a non-empty string or a list of them", param="stop_regex")
    if len(patterns) > MAX_PATTERNS:
        raise InvalidRequest(f"stop_regex may hold at most {MAX_PATTERNS} patterns", param="stop_regex")
    if any(len(p) > MAX_PATTERN_LENGTH for p in patterns):
        raise InvalidRequest(f"a stop_regex pattern may be at most {MAX_PATTERN_LENGTH} characters",
                             param="stop_regex")
    return tuple(compile_pattern(p) for p in patterns)


def parse_stop_after_lines(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest("stop_after_lines must be an integer >= 1", param="stop_after_lines")
    return value


@hookimpl
def trtserver_stop_checkers(request: CompletionRequest, context: RequestContext) -> list[Callable[[], StopChecker]]:
    factories: list[Callable[[], StopChecker]] = []
    if context.extra.get("stop_regex") is not None:
        patterns = parse_stop_regex(context.extra["stop_regex"])
        factories.append(lambda: RegexStop(patterns))
    if context.extra.get("stop_after_lines") is not None:
        lines = parse_stop_after_lines(context.extra["stop_after_lines"])
        factories.append(lambda: LineStop(lines))
    return factories
