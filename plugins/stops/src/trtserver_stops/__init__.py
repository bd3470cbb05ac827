"""Custom stop conditions, as request fields trtserver itself does not know.

``stop_regex`` (a pattern or a list of up to ``MAX_PATTERNS`` patterns of at most
``MAX_PATTERN_LENGTH`` characters, Python ``re`` syntax): generation stops at the earliest match in
the generated text; the match is cut off like a stop string (kept with
``include_stop_str_in_output``) and ``stop_reason`` is the pattern that matched. A pattern that does
not compile, that matches the empty string, or that linear-time matching cannot run
(backreferences, lookaround, atomic groups, possessive quantifiers; see ``linear.py``) is a 400
naming ``stop_regex``.

Patterns run on RE2 (``google-re2``), so matching costs time linear in the text, whatever the
pattern. Streams never send text that could still become part of a match: ``hold`` finds, with
the pattern's prefix closure, the earliest position from which the text could still grow into a
match, and everything from there on is withheld until more text decides it. That position
never moves back as the text grows, so both searches start there: each token rescans only the
withheld tail. Matches are decided on the text generated so far (``a+`` stops at the first
``a``; ``x$`` matches whenever the text so far ends in ``x``), identically for streamed and
non-streamed requests.

``stop_after_lines: N`` (an integer >= 1): stop once N newline-terminated lines were generated; the
text ends with the N-th newline and ``stop_reason`` is ``"lines:N"``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import re2

from trtserver import hookimpl
from trtserver.errors import InvalidRequest
from trtserver.text import StopMatch
from trtserver_stops.linear import UnsupportedPattern, translate

if TYPE_CHECKING:
    from trtserver.protocol import CompletionRequest
    from trtserver.request_context import RequestContext
    from trtserver.text import StopChecker

__version__ = "0.1.0"

MAX_PATTERNS = 16
MAX_PATTERN_LENGTH = 1000


class StopPattern(NamedTuple):
    """A client's pattern as RE2 programs: the pattern itself and its prefix closure at the end."""

    pattern: str
    search: Any  # re2 pattern
    partial: Any  # re2 pattern


class RegexStop:
    """Stop at the earliest match of any of ``patterns``."""

    def __init__(self, patterns: tuple[StopPattern, ...]) -> None:
        self.patterns = patterns
        self._text = ""
        self._floor = 0  # no match can start before this: the earliest possible start so far

    def _follow(self, text: str) -> int:
        if text is not self._text and not text.startswith(self._text):  # another text: start again
            self._floor = 0
        self._text = text
        return min(self._floor, len(text))

    def find(self, text: str, new_from: int) -> StopMatch | None:
        floor = self._follow(text)
        best: StopMatch | None = None
        for stop in self.patterns:
            match = stop.search.search(text, floor)
            if match is not None and (best is None or match.start() < best.start):
                best = StopMatch(match.start(), match.end(), stop.pattern)
        if best is None:
            self._floor = len(text) - self.hold(text)
        return best

    def hold(self, text: str) -> int:
        floor = self._follow(text)
        earliest = len(text)
        for stop in self.patterns:
            match = stop.partial.search(text, floor)
            if match is not None:
                earliest = min(earliest, match.start())
        self._floor = earliest
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


def _re2(pattern: str) -> Any:
    options = re2.Options()
    options.log_errors = False
    return re2.compile(pattern, options)


@functools.lru_cache(maxsize=256)
def compile_pattern(pattern: str) -> StopPattern:
    try:
        whole, partial = translate(pattern)
        compiled = StopPattern(pattern, _re2(whole), _re2(partial))
    except UnsupportedPattern as exc:
        raise InvalidRequest(f"stop_regex {pattern!r} is not supported: {exc}", param="stop_regex") from exc
    except (re.error, re2.error, ValueError, OverflowError, RecursionError) as exc:
        raise InvalidRequest(f"stop_regex {pattern!r} is not a valid regular expression: {exc}",
                             param="stop_regex") from exc
    if compiled.search.fullmatch("") is not None:
        raise InvalidRequest(f"stop_regex {pattern!r} matches the empty string", param="stop_regex")
    return compiled


def parse_stop_regex(value: Any) -> tuple[StopPattern, ...]:
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
