"""Python regular expressions matched in linear time: translated to RE2, with their prefix closure.

``translate(pattern)`` parses the pattern with Python's own parser and writes two RE2 patterns:
the pattern itself (groups made non-capturing) and its *prefix closure*, which matches exactly
the strings that are a prefix of some match (the empty string included). The prefix closure
anchored at the end of the text gives the earliest position from which the text could still
grow into a match, which is what a stream must withhold. RE2 runs both in time linear in the
text, whatever the pattern.

What RE2 cannot do in linear time is refused with ``UnsupportedPattern``: backreferences,
lookahead and lookbehind, conditionals, atomic groups and possessive quantifiers. ``\\d``, ``\\w``
and ``\\s`` keep Python's Unicode meaning; ``\\b`` and ``\\B`` are RE2's, which count ASCII letters,
digits and ``_`` as word characters only.
"""

from __future__ import annotations

import re
from typing import Any

try:
    from re import _parser as sre  # type: ignore[attr-defined]
except ImportError:  # Python 3.10
    import sre_parse as sre  # type: ignore[no-redef]


class UnsupportedPattern(ValueError):
    pass


_FLAGS = ((re.IGNORECASE, "i"), (re.MULTILINE, "m"), (re.DOTALL, "s"))
_UNICODE_SPACE = r"\t\n\x{b}\f\r\x{1c}-\x{1f}\x{85}\p{Z}"
_ASCII_SPACE = r"\t\n\x{b}\f\r\x{20}"
_UNICODE_WORD = r"\p{L}\p{N}_"
_ASCII_WORD = r"0-9A-Za-z_"


def _char(code: int) -> str:
    char = chr(code)
    return char if char.isascii() and char.isalnum() else f"\\x{{{code:x}}}"


def _flag_letters(flags: int) -> str:
    return "".join(letter for bit, letter in _FLAGS if flags & bit)


class _Writer:
    def __init__(self, ascii_only: bool) -> None:
        self.ascii = [ascii_only]

    # one category: (items for a positive class, or None) and (items whose complement it is, or None)
    def _category(self, name: Any) -> tuple[str | None, str | None]:
        ascii_only = self.ascii[-1]
        digit = "0-9" if ascii_only else r"\p{Nd}"
        space = _ASCII_SPACE if ascii_only else _UNICODE_SPACE
        word = _ASCII_WORD if ascii_only else _UNICODE_WORD
        table = {
            sre.CATEGORY_DIGIT: (digit, None), sre.CATEGORY_NOT_DIGIT: (None, digit),
            sre.CATEGORY_SPACE: (space, None), sre.CATEGORY_NOT_SPACE: (None, space),
            sre.CATEGORY_WORD: (word, None), sre.CATEGORY_NOT_WORD: (None, word),
        }
        if name not in table:
            raise UnsupportedPattern(f"character category {name} is not supported")
        return table[name]

    def char_class(self, items: list[tuple[Any, Any]]) -> str:
        negate = False
        positive: list[str] = []
        complements: list[str] = []
        for op, av in items:
            if op is sre.NEGATE:
                negate = True
            elif op is sre.LITERAL:
                positive.append(_char(av))
            elif op is sre.RANGE:
                positive.append(f"{_char(av[0])}-{_char(av[1])}")
            elif op is sre.CATEGORY:
                plain, complement = self._category(av)
                if plain is not None:
                    positive.append(plain)
                else:
                    complements.append(str(complement))
            else:
                raise UnsupportedPattern(f"{op} inside a character class is not supported")
        if negate:
            if complements and positive:
                raise UnsupportedPattern(r"a negated character class holding \D, \S or \W is not supported")
            if len(complements) > 1:
                raise UnsupportedPattern(r"a negated character class holding two of \D, \S, \W is not supported")
            if complements:
                return f"[{complements[0]}]"
            return "[^" + "".join(positive) + "]" if positive else r"[\x{0}-\x{10ffff}]"
        parts = (["[" + "".join(positive) + "]"] if positive else []) + [f"[^{c}]" for c in complements]
        if not parts:
            return r"[^\x{0}-\x{10ffff}]"
        return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"

    def atom(self, op: Any, av: Any) -> str | None:
        """A single-character matcher, or None if ``op`` is not one."""
        if op is sre.LITERAL:
            return _char(av)
        if op is sre.NOT_LITERAL:
            return f"[^{_char(av)}]"
        if op is sre.ANY:
            return "."
        if op is sre.IN:
            return self.char_class(av)
        return None

    def full(self, seq: Any) -> str:
        return "".join(self.node(op, av, prefix=False) for op, av in seq)

    def prefix(self, seq: Any) -> str:
        # P(x1 x2 .. xn) = x1 P(x2 .. xn) | P(x1), nested from the right: linear in size
        out = ""
        for op, av in reversed(list(seq)):
            whole = self.node(op, av, prefix=False)
            head = self.node(op, av, prefix=True)
            out = f"(?:{whole}{out}|{head})" if out else head
        return out

    def node(self, op: Any, av: Any, *, prefix: bool) -> str:
        single = self.atom(op, av)
        if single is not None:
            return f"(?:{single})?" if prefix else single
        if op is sre.SUBPATTERN:
            _group, add, remove, body = av
            if add & re.LOCALE:
                raise UnsupportedPattern("the LOCALE flag is not supported")
            self.ascii.append(bool(add & re.ASCII) or (self.ascii[-1] and not remove & re.UNICODE))
            try:
                inner = self.prefix(body) if prefix else self.full(body)
            finally:
                self.ascii.pop()
            on, off = _flag_letters(add), _flag_letters(remove)
            flags = on + ("-" + off if off else "")
            return f"(?{flags}:{inner})"
        if op is sre.BRANCH:
            render = self.prefix if prefix else self.full
            return "(?:" + "|".join(render(alt) for alt in av[1]) + ")"
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
            low, high, body = av
            whole = self.full(body)
            if not prefix:
                count = _count(low, high)
                return f"(?:{whole}){count}{'?' if op is sre.MIN_REPEAT else ''}"
            # prefixes of x{low,high}: up to high-1 whole repeats, then a prefix of one more
            if high == 0:
                return ""
            head = self.prefix(body)
            repeats = "*" if high == sre.MAXREPEAT else "" if high == 1 else _count(0, high - 1)
            return f"(?:{whole}){repeats}{head}" if repeats else head
        if op is sre.AT:
            return _anchor(av, prefix)
        name = {sre.GROUPREF: "backreferences", sre.GROUPREF_EXISTS: "conditional groups",
                sre.ASSERT: "lookahead and lookbehind", sre.ASSERT_NOT: "lookahead and lookbehind"}.get(op)
        if name is None:
            name = "atomic groups and possessive quantifiers" if str(op) in (
                "ATOMIC_GROUP", "POSSESSIVE_REPEAT") else str(op)
        raise UnsupportedPattern(f"{name} cannot be matched in linear time")


def _count(low: int, high: int) -> str:
    if high == sre.MAXREPEAT:
        return "*" if low == 0 else "+" if low == 1 else f"{{{low},}}"
    if low == high:
        return f"{{{low}}}"
    return "?" if (low, high) == (0, 1) else f"{{{low},{high}}}"


def _anchor(at: Any, prefix: bool) -> str:
    table = {sre.AT_BEGINNING: "^", sre.AT_BEGINNING_STRING: r"\A", sre.AT_END: "$",
             sre.AT_END_STRING: r"\z", sre.AT_BOUNDARY: r"\b", sre.AT_NON_BOUNDARY: r"\B"}
    if at not in table:
        raise UnsupportedPattern(f"anchor {at} is not supported")
    text = table[at]
    if prefix and at in (sre.AT_BOUNDARY, sre.AT_NON_BOUNDARY):
        return f"(?:{text}|\\z)"  # at the end of the text, what comes next decides
    return text


def translate(pattern: str) -> tuple[str, str]:
    """(the pattern, its prefix closure) in RE2 syntax; raises ``re.error`` or ``UnsupportedPattern``."""
    parsed = sre.parse(pattern)
    flags = parsed.state.flags
    if flags & re.LOCALE:
        raise UnsupportedPattern("the LOCALE flag is not supported")
    writer = _Writer(ascii_only=bool(flags & re.ASCII))
    letters = _flag_letters(flags)
    lead = f"(?{letters})" if letters else ""
    return lead + writer.full(parsed), lead + f"(?:{writer.prefix(parsed)})\\z"
