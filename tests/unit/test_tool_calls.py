"""Tool calls: the hermes parser (incremental, any split), the parser registry, and tool_choice named/required."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest

from trtserver import hookimpl
from trtserver.builtins.hermes_tool_parser import HermesToolParser
from trtserver.errors import InvalidRequest
from trtserver.plugins import PluginLoadError, load_plugins, new_plugin_manager
from trtserver.tool_calls import (
    ContentDelta,
    NamedToolParser,
    RequiredToolParser,
    ToolCall,
    ToolCallArguments,
    ToolCallParser,
    ToolCallStart,
    ToolDelta,
    ToolParserNotFound,
    calls_from_required_output,
    collect,
    named_tool_schema,
    registered_tool_parsers,
    required_tools_schema,
    tool_parser_factory,
)

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
                       "required": ["city"], "additionalProperties": False,
                       "$defs": {"unit": {"type": "string", "enum": ["C", "F"]}}}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object",
                                      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                      "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now"}},
]

TWO_CALLS = ('I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n')


def run(parser: ToolCallParser, pieces: list[str]) -> list[ToolDelta]:
    out: list[ToolDelta] = []
    for piece in pieces:
        out.extend(parser.feed(piece))
    return out + parser.finish()


def hermes(text: str, pieces: list[str] | None = None) -> tuple[str, list[tuple[str, str]]]:
    content, calls = collect(run(HermesToolParser(TOOLS), pieces if pieces is not None else [text]))
    return content, [(call.name, call.arguments) for call in calls]


def random_split(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


# --- hermes -------------------------------------------------------------------------------------


def test_two_calls_with_content_before() -> None:
    deltas = run(HermesToolParser(TOOLS), [TWO_CALLS])
    assert [type(d) for d in deltas] == [ContentDelta, ToolCallStart, ToolCallArguments, ToolCallStart,
                                         ToolCallArguments]
    starts = [d for d in deltas if isinstance(d, ToolCallStart)]
    assert [(s.index, s.name) for s in starts] == [(0, "get_weather"), (1, "add")]
    assert all(s.id.startswith("call_") and len(s.id) > 10 for s in starts) and starts[0].id != starts[1].id
    assert hermes(TWO_CALLS) == ("I will check both.", [("get_weather", '{"city": "Zürich"}'),
                                                        ("add", '{"a": 1, "b": 2}')])


@pytest.mark.parametrize("text", [
    TWO_CALLS,
    "no calls at all, and trailing space  \n",
    'a <tool_call> b <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> tail <tool_',
    '<tool_call>{"name": "add", "arguments": {bad json}}</tool_call> then <tool_call>{"name": "now"}</tool_call>',
    '<tool_call>{"name": "now", "arguments": {}}',  # stopped before closing
    "almost <tool_cal",
    "\n\n<tool_call>[1, 2]</tool_call>\n",
])
def test_any_split_gives_the_same_result(text: str) -> None:
    whole = hermes(text)
    assert hermes(text, list(text)) == whole  # one character at a time
    for seed in range(25):
        assert hermes(text, random_split(text, seed)) == whole, seed


def test_content_streams_at_once_holding_only_a_possible_tag() -> None:
    parser = HermesToolParser(TOOLS)
    assert parser.feed("Hello wor") == [ContentDelta("Hello wor")]
    assert parser.feed("ld <tool") == [ContentDelta("ld")]  # " <tool" could begin a call
    assert parser.feed("box> ok") == [ContentDelta(" <toolbox> ok")]
    assert parser.feed("<tool_call>") == []
    assert parser.feed('{"name": "now", "arguments": {}}') == []  # arguments wait for the closing tag
    deltas = parser.feed("</tool_call>")
    assert [type(d) for d in deltas] == [ToolCallStart, ToolCallArguments]
    assert parser.finish() == []


def test_plain_text_comes_through_unchanged() -> None:
    text = "Line one.\n\n  Indented <b>bold</b> < tool_call > and a lone <tool_call"
    assert hermes(text, list(text)) == (text, [])


def test_malformed_calls_are_content_as_generated() -> None:
    text = 'Try:\n<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'
    assert hermes(text) == (text, [])
    assert hermes("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert hermes('<tool_call>{"arguments": {}}</tool_call>') == ('<tool_call>{"arguments": {}}</tool_call>', [])
    assert hermes('<tool_call>{"name": "add", "arguments": 5}</tool_call>')[1] == []
    assert hermes("<tool_call>{unclosed") == ("<tool_call>{unclosed", [])


def test_unclosed_last_call_and_argument_forms() -> None:
    assert hermes('<tool_call>\n{"name": "now"}\n') == ("", [("now", "{}")])
    assert hermes('<tool_call>{"name": "add", "parameters": {"a": 1, "b": 2}}</tool_call>')[1] == [
        ("add", '{"a": 1, "b": 2}')]
    assert hermes('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>')[1] == [("add", '{"a": 1}')]


def test_whitespace_around_calls_is_no_content() -> None:
    assert hermes("\n<tool_call>{\"name\": \"now\"}</tool_call>\n\n") == ("", [("now", "{}")])
    assert hermes('<tool_call>{"name": "now"}</tool_call>\nDone.') == ("\nDone.", [("now", "{}")])


# --- registry -----------------------------------------------------------------------------------


class Registers:
    def __init__(self, *names: str) -> None:
        self.names = names

    @hookimpl
    def trtserver_register_tool_parsers(self, register: Any) -> None:
        for name in self.names:
            register(name, HermesToolParser)


def test_builtin_hermes_is_registered_like_a_plugin() -> None:
    pm = new_plugin_manager()
    load_plugins(pm, allowlist=[])
    assert "trtserver.builtins.hermes_tool_parser" in dict(pm.list_name_plugin())
    assert registered_tool_parsers(pm)["hermes"] is HermesToolParser
    assert isinstance(tool_parser_factory(pm, "hermes")(TOOLS), HermesToolParser)


def test_unknown_parser_lists_the_registered_ones() -> None:
    pm = new_plugin_manager()
    pm.register(Registers("alpha", "beta"), name="mine")
    with pytest.raises(ToolParserNotFound, match="'gamma'.*registered parsers: alpha, beta"):
        tool_parser_factory(pm, "gamma")


def test_one_name_from_two_plugins_stops_start_up_naming_both() -> None:
    pm = new_plugin_manager()
    pm.register(Registers("shared", "first_only"), name="first_plugin")
    pm.register(Registers("shared"), name="second_plugin")
    with pytest.raises(PluginLoadError) as caught:
        registered_tool_parsers(pm)
    assert "'shared'" in str(caught.value)
    assert "first_plugin" in str(caught.value) and "second_plugin" in str(caught.value)
    pm = new_plugin_manager()
    pm.register(Registers("twice", "twice"), name="careless")
    with pytest.raises(PluginLoadError, match="'twice' is registered by both 'careless' and 'careless'"):
        registered_tool_parsers(pm)


# --- tool_choice --------------------------------------------------------------------------------


def test_named_schema_is_the_functions_parameters() -> None:
    schema = named_tool_schema(TOOLS, "add")
    assert schema == TOOLS[1]["function"]["parameters"] and schema is not TOOLS[1]["function"]["parameters"]
    assert named_tool_schema(TOOLS, "now") == {"type": "object", "properties": {}}
    with pytest.raises(InvalidRequest) as caught:
        named_tool_schema(TOOLS, "missing")
    assert caught.value.param == "tool_choice" and "'missing'" in caught.value.message


def test_named_output_round_trip() -> None:
    generated = '{"a": 4, "b": 5}'
    jsonschema.validate(json.loads(generated), named_tool_schema(TOOLS, "add"))
    deltas = run(NamedToolParser("add"), list(generated))
    assert isinstance(deltas[0], ToolCallStart) and deltas[0].name == "add" and deltas[0].index == 0
    content, calls = collect(deltas)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("add", generated)]
    empty = collect(run(NamedToolParser("now"), []))[1]  # nothing generated: still the one call
    assert [(c.name, c.arguments) for c in empty] == [("now", "")]


def test_required_schema_accepts_only_lists_of_known_calls() -> None:
    schema = required_tools_schema(TOOLS)
    assert schema["$defs"] == {"unit": {"type": "string", "enum": ["C", "F"]}}
    assert "$defs" in TOOLS[0]["function"]["parameters"]  # the request's tools are left as they were
    good = [{"name": "get_weather", "arguments": {"city": "Bern", "unit": "C"}},
            {"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "now", "arguments": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "add", "arguments": {"a": "1", "b": 2}}], [{"name": "other", "arguments": {}}],
                [{"name": "get_weather", "arguments": {"city": "Bern", "unit": "K"}}], [{"name": "add"}],
                {"name": "add", "arguments": {"a": 1, "b": 2}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_tools_schema(TOOLS, parallel=False)
    jsonschema.validate(good[:1], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)


def test_required_schema_compiles_for_guided_decoding() -> None:
    xgrammar = pytest.importorskip("xgrammar")
    assert "root" in str(xgrammar.Grammar.from_json_schema(json.dumps(required_tools_schema(TOOLS))))


def test_required_schema_errors() -> None:
    with pytest.raises(InvalidRequest) as caught:
        required_tools_schema([])
    assert caught.value.param == "tools"
    clash = [TOOLS[0], {"type": "function", "function": {"name": "x", "parameters": {
        "type": "object", "$defs": {"unit": {"type": "integer"}}}}}]
    with pytest.raises(InvalidRequest, match="'unit'"):
        required_tools_schema(clash)
    with pytest.raises(InvalidRequest, match="type"):
        required_tools_schema([{"type": "retrieval"}])


def test_required_output_round_trip() -> None:
    generated = json.dumps([{"name": "get_weather", "arguments": {"city": "Zürich {x}", "unit": "C"}},
                            {"name": "add", "arguments": {"a": 1, "b": 2}}], ensure_ascii=False, indent=1)
    jsonschema.validate(json.loads(generated), required_tools_schema(TOOLS))
    calls = calls_from_required_output(generated)
    assert calls is not None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Zürich {x}", "unit": "C"}), ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in calls}) == 2 and all(isinstance(c, ToolCall) for c in calls)
    streamed = collect(run(RequiredToolParser(), list(generated)))
    assert streamed[0] == "" and [(c.name, c.arguments) for c in streamed[1]] == [(c.name, c.arguments) for c in calls]
    for seed in range(10):
        again = collect(run(RequiredToolParser(), random_split(generated, seed)))
        assert [(c.name, c.arguments) for c in again[1]] == [(c.name, c.arguments) for c in calls]


def test_required_output_cut_short() -> None:
    cut = '[{"name": "add", "arguments": {"a": 1, "b"'
    assert calls_from_required_output(cut) is None and calls_from_required_output("[]") is None
    assert collect(run(RequiredToolParser(), list(cut))) == (cut, [])
    one_then_cut = '[{"name": "now", "arguments": {}}, {"name": "ad'
    content, calls = collect(run(RequiredToolParser(), [one_then_cut]))
    assert [(c.name, c.arguments) for c in calls] == [("now", "{}")]


def test_auto_without_a_parser_names_the_flag() -> None:
    from trtserver.tool_calls import ToolParserMissing

    error = ToolParserMissing()
    assert error.status == 400 and error.param == "tool_choice" and "--tool-call-parser" in error.message


def test_modules_the_chat_shaper_imports_stay_free_of_aiohttp_and_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, trtserver.tool_calls, trtserver.chat_template, trtserver.builtins.hermes_tool_parser; "
            "print(sorted({'aiohttp', 'torch'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.strip() == "[]"
