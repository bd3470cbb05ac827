from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import regex
import trtserver_stops
from aiohttp.test_utils import TestClient
from trtserver_stops import LineStop, RegexStop, parse_stop_regex

from trtserver.errors import InvalidRequest
from trtserver.testing import serve
from trtserver.text import StopMatch

LIST_PROMPT = "Shopping list:\n- eggs\n- milk\n-"
PROSE_PROMPT = "The capital of France is"


# --- checkers ----------------------------------------------------------------------------------


def test_regex_find_earliest_over_patterns() -> None:
    checker = RegexStop(parse_stop_regex([r"\d{3}", r"b+"]))
    assert checker.find("a 12", 0) is None
    assert checker.find("a 1234 bb", 3) == StopMatch(2, 5, r"\d{3}")
    assert checker.find("abb 123", 0) == StopMatch(1, 3, "b+")


def test_regex_hold_withholds_exactly_what_could_still_match() -> None:
    checker = RegexStop(parse_stop_regex(r"END\d"))
    assert checker.hold("hello") == 0
    assert checker.hold("hello E") == 1
    assert checker.hold("hello EN") == 2
    assert checker.hold("hello END") == 3
    assert checker.hold("hello ENX") == 0
    # the earliest possible start wins across patterns
    both = RegexStop(parse_stop_regex([r"ab\d", r"b.c"]))
    assert both.hold("xab") == 2


def test_regex_stream_never_sends_a_possible_match() -> None:
    """Feed text char by char: everything not held is a prefix of the final, cut text."""
    checker = RegexStop(parse_stop_regex(r"[0-9]{2}-[0-9]{2}"))
    full = "dates: 1-2, 12-3, 12-34 and more"
    sent = ""
    for i in range(1, len(full) + 1):
        text = full[:i]
        match = checker.find(text, i - 1)
        if match is not None:
            final = text[: match.start]
            break
        sent = text[: len(text) - checker.hold(text)]
        assert regex.search(r"[0-9]{2}-[0-9]{2}", sent) is None
    assert final == "dates: 1-2, 12-3, " and final.startswith(sent)


@pytest.mark.parametrize("bad", ["(", "a{2,1}", "", "a*", "x?", 3, ["ok", 4], [], ["a"] * 17])
def test_regex_rejects_bad_patterns(bad: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_stop_regex(bad)
    assert info.value.param == "stop_regex"


@pytest.mark.timeout(20)
@pytest.mark.parametrize("pattern", [r"(a|aa)+b", r"(a+)+b", r"(a*)*b", r"(a|a?)+b", r"(\w+\s?)+!"])
def test_regex_work_per_token_is_linear(pattern: str) -> None:
    """Patterns that backtrack exponentially, over forced text that almost matches: milliseconds."""
    import time

    checker = RegexStop(parse_stop_regex(pattern))
    text = ""
    start = time.perf_counter()
    for i in range(200):
        new_from = len(text)
        text += "a"
        assert checker.find(text, new_from) is None
        assert checker.hold(text) == len(text), i
    assert time.perf_counter() - start < 1.0


SAFE_PIECES = ["a", "b", "ab", "[ab]", "[^a]", "b?", "a*", "(a|bb)", "(?:ab)+", "a{1,3}", "\\d", "\\s", "\\w",
               "\\W", ".", "[\\da]", "(?i:A)", "a+?", "\\bb"]


def test_regex_agrees_with_python_semantics() -> None:
    """Random patterns fed random text piece by piece: the stop found and the hold-back are those of
    Python's own regex matching (the ``regex`` module's search, and its partial search)."""
    import random

    rng = random.Random(3)
    for _ in range(400):
        pattern = "".join(rng.choice(SAFE_PIECES) for _ in range(rng.randint(1, 4)))
        try:
            compiled = regex.compile(pattern)
            if compiled.fullmatch(""):
                continue
        except regex.error:
            continue
        checker = RegexStop(parse_stop_regex(pattern))
        alphabet = "ab 1\n" if "\\b" in pattern else "ab 1\né"  # RE2's \b knows ASCII words only
        full = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20)))
        text = ""
        while len(text) < len(full):
            new_from = len(text)
            text = full[: new_from + rng.randint(1, 3)]
            expected = compiled.search(text)
            found = checker.find(text, new_from)
            if expected is not None:
                assert found is not None and (found.start, found.end) == expected.span(), (pattern, text)
                break
            assert found is None, (pattern, text)
            # what could still match does not depend on laziness (and regex's partial search of a
            # lazy quantifier reports starts that cannot match)
            partial = regex.search(pattern.replace("+?", "+"), text, partial=True)
            if "\\b" not in pattern:  # regex decides a \b at the end of the text as if nothing followed
                assert checker.hold(text) == (len(text) - partial.start() if partial else 0), (pattern, text)


def test_regex_hold_keeps_a_word_boundary_the_next_text_decides() -> None:
    checker = RegexStop(parse_stop_regex(r".\bb"))
    assert checker.hold("1 ") == 1  # " b" would match
    assert checker.find("1 b", 2) == StopMatch(1, 3, r".\bb")


@pytest.mark.parametrize("bad", [r"(a)\1", r"a(?=b)", r"(?<!x)a", r"a++", r"(?>ab)c", "a{2000}"])
def test_regex_refuses_what_linear_matching_cannot_do(bad: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_stop_regex(bad)
    assert info.value.param == "stop_regex"


def test_lines() -> None:
    checker = LineStop(2)
    assert checker.find("a\nb", 0) is None
    assert checker.find("a\nb\nc\n", 2) == StopMatch(4, 4, "lines:2")
    assert checker.hold("a\nb") == 0


# --- over HTTP, on the real model ---------------------------------------------------------------


@pytest.fixture(scope="module")
async def client() -> AsyncIterator[TestClient[Any, Any]]:
    async with serve([trtserver_stops], installed_plugins=False, max_model_len=512) as test_client:
        yield test_client


# seeded: a repeated prompt takes no cached prefix, whose shorter prefill may round a near tie apart
GREEDY = {"max_tokens": 16, "temperature": 0, "seed": 0}


async def complete(client: TestClient[Any, Any], **body: Any) -> dict[str, Any]:
    response = await client.post("/v1/completions", json={**GREEDY, **body})
    assert response.status == 200, await response.text()
    return await response.json()  # type: ignore[no-any-return]


async def stream(client: TestClient[Any, Any], **body: Any) -> list[dict[str, Any]]:
    response = await client.post("/v1/completions", json={**GREEDY, "stream": True, **body})
    assert response.status == 200
    events = [line[6:] for line in (await response.text()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


pytestmark_http = pytest.mark.asyncio(loop_scope="session")


@pytestmark_http
async def test_stop_regex_stream_and_non_stream_agree(client: TestClient[Any, Any]) -> None:
    plain = (await complete(client, prompt=PROSE_PROMPT))["choices"][0]["text"]
    middle = len(plain) // 2
    # a pattern several tokens long, with a wildcard, found in the middle of the greedy output
    pattern = regex.escape(plain[middle:middle + 3]) + "." + regex.escape(plain[middle + 4:middle + 8])
    expected = plain[: regex.search(pattern, plain).start()]  # type: ignore[union-attr]

    whole = (await complete(client, prompt=PROSE_PROMPT, stop_regex=pattern))["choices"][0]
    assert (whole["text"], whole["finish_reason"], whole["stop_reason"]) == (expected, "stop", pattern)

    chunks = await stream(client, prompt=PROSE_PROMPT, stop_regex=[pattern])
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == pattern
    sent = ""
    for chunk in chunks[:-1]:  # before the end, no sent text may end in what could become a match
        sent += chunk["choices"][0]["text"]
        partial = regex.search(pattern, sent, partial=True)
        assert partial is None or partial.start() == len(sent), sent


@pytestmark_http
async def test_stop_regex_include_stop_str_in_output(client: TestClient[Any, Any]) -> None:
    whole = (await complete(client, prompt=PROSE_PROMPT, stop_regex=r"[A-Z]\w+\.",
                            include_stop_str_in_output=True))["choices"][0]
    assert whole["text"] == " Paris." and whole["stop_reason"] == r"[A-Z]\w+\."


@pytestmark_http
async def test_stop_after_lines(client: TestClient[Any, Any]) -> None:
    whole = (await complete(client, prompt=LIST_PROMPT, stop_after_lines=2))["choices"][0]
    assert whole["text"].count("\n") == 2 and whole["text"].endswith("\n")
    assert (whole["finish_reason"], whole["stop_reason"]) == ("stop", "lines:2")
    chunks = await stream(client, prompt=LIST_PROMPT, stop_after_lines=2)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert chunks[-1]["choices"][0]["stop_reason"] == "lines:2"


@pytestmark_http
@pytest.mark.parametrize(("field", "value"), [("stop_regex", "(unclosed"), ("stop_regex", ".*"),
                                              ("stop_after_lines", 0), ("stop_after_lines", "2")])
async def test_bad_fields_are_400(client: TestClient[Any, Any], field: str, value: Any) -> None:
    response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, field: value})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
