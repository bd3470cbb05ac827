"""How large a guide becomes once its counted repetitions are unrolled, estimated from its text.

Compilers that build automata or token tables (xgrammar's) spend time in proportion to that size:
``[^x]{1,10000}`` takes seconds, ``(.{1,1000}){1,1000}`` far longer, whatever the length of the
text. ``regex_weight`` counts each atom once, multiplied by the upper bounds of the ``{m,n}``
around it (``{m,}`` counts ``m + 1``); ``grammar_weight`` does the same for EBNF / GBNF / Lark
rules, a rule reference weighing what its rule does (recursion counts once). Character classes
and quoted strings weigh 1. The estimate errs on the high side for alternations.
"""

from __future__ import annotations

import re

_COUNT = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}")
_RULE = re.compile(r"^[ \t]*[?!]?([A-Za-z_][\w.-]*)[ \t]*(?:\.\d+)?[ \t]*(::=|:)", re.MULTILINE)
_NAME = re.compile(r"[A-Za-z_][\w.-]*")
_CAP = 10**12  # stop multiplying: anything this big is refused anyway


def _skip_class(text: str, i: int) -> int:
    """Index after the character class opening at ``text[i] == '['``."""
    i += 1
    if i < len(text) and text[i] == "^":
        i += 1
    if i < len(text) and text[i] == "]":
        i += 1
    while i < len(text) and text[i] != "]":
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _skip_string(text: str, i: int) -> int:
    quote = text[i]
    i += 1
    while i < len(text) and text[i] != quote:
        i += 2 if text[i] == "\\" else 1
    return i + 1


class _Weigher:
    def __init__(self, text: str, grammar: bool, rules: dict[str, int]) -> None:
        self.text, self.grammar, self.rules = text, grammar, rules

    def sequence(self, i: int) -> tuple[int, int]:
        """Weight of the alternatives from ``i`` up to an unmatched ``)`` (or the end), and where."""
        text, total = self.text, 0
        while i < len(text) and text[i] != ")":
            if text[i] in "|*+?" or text[i].isspace():
                i += 1
                continue
            weight, i = self.atom(i)
            while i < len(text) and (m := _COUNT.match(text, i)):  # x{m,n}: n copies of x
                low, high = int(m.group(1)), m.group(3)
                bound = int(high) if high else low + 1 if m.group(2) is not None else low
                weight, i = min(_CAP, weight * max(bound, 1)), m.end()
            total = min(_CAP, total + weight)
        return total, i

    def atom(self, i: int) -> tuple[int, int]:
        text, c = self.text, self.text[i]
        if c == "\\":
            return 1, i + 2
        if c == "[":
            return 1, _skip_class(text, i)
        if c == "(":
            weight, i = self.sequence(i + 1)
            return weight, i + 1
        if self.grammar:
            if c in "\"'":
                return 1, _skip_string(text, i)
            if c == "/":  # a Lark regex terminal
                end = _skip_string(text, i)
                return _Weigher(text[i + 1:end - 1], False, {}).sequence(0)[0], end
            if m := _NAME.match(text, i):
                return self.rules.get(m.group(0), 1), m.end()
        return 1, i + 1


def regex_weight(pattern: str) -> int:
    weigher = _Weigher(pattern, False, {})
    total, i = 0, 0
    while i < len(pattern):  # an unbalanced ")" is the compiler's error to report: weigh on
        weight, i = weigher.sequence(i)
        total, i = min(_CAP, total + weight), i + 1
    return total


def grammar_weight(grammar: str) -> int:
    """Weight of the start rule (``root`` or ``start``, else the first), references unrolled."""
    heads = list(_RULE.finditer(grammar))
    bodies = {m.group(1): grammar[m.end():heads[k + 1].start() if k + 1 < len(heads) else len(grammar)]
              for k, m in enumerate(heads)}
    weights: dict[str, int] = {}

    def weigh(name: str, seen: frozenset[str]) -> int:
        if name in weights:
            return weights[name]
        refs = {ref: weigh(ref, seen | {name}) for ref in set(_NAME.findall(bodies[name]))
                if ref in bodies and ref not in seen and ref != name}
        weight = regex_like(bodies[name], refs)
        weights[name] = weight
        return weight

    def regex_like(body: str, refs: dict[str, int]) -> int:
        weigher = _Weigher(body, True, refs)
        total, i = 0, 0
        while i < len(body):
            weight, i = weigher.sequence(i)
            total, i = min(_CAP, total + weight), i + 1
        return total

    if not bodies:
        return regex_like(grammar, {})
    start = next((n for n in ("root", "start") if n in bodies), heads[0].group(1))
    return weigh(start, frozenset())


def schema_patterns(node: object) -> set[str]:
    """Every string ``pattern`` in a JSON schema."""
    found: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                found.add(value)
            else:
                found |= schema_patterns(value)
    elif isinstance(node, list):
        for item in node:
            found |= schema_patterns(item)
    return found
