"""Tool calls in generated text: the parser interface and registry, and ``tool_choice`` named / required.

Each choice of a chat request with tools gets its own parser, fed the choice's text as it is
generated; it returns :data:`ToolDelta` items: content text, the start of a call (index, id,
function name) and fragments of a call's arguments (JSON text). Non-streamed responses are the
same deltas collected (:func:`collect`).

- ``tool_choice: "auto"``: ``tool_parser_factory(pm, config.tool_call_parser)(tools)``, a parser
  registered through ``trtserver_register_tool_parsers`` (built in: ``hermes``).
- a named function: guided JSON with :func:`named_tool_schema`; the text is that call's
  arguments (:class:`NamedToolParser`).
- ``"required"``: guided JSON with :func:`required_tools_schema`, a list of
  ``{"name", "arguments"}`` objects (:class:`RequiredToolParser`).

Imports neither aiohttp nor torch.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import msgspec

from trtserver.errors import InvalidRequest

if TYPE_CHECKING:
    import pluggy


class ContentDelta(msgspec.Struct, frozen=True):
    """Text that is the message's content (not part of a call)."""

    text: str


class ToolCallStart(msgspec.Struct, frozen=True):
    """A call begins: ``index`` counts calls from 0 within the choice; ``id`` is ``call_...``."""

    index: int
    id: str
    name: str


class ToolCallArguments(msgspec.Struct, frozen=True):
    """A fragment of call ``index``'s arguments (JSON text; the fragments joined are the whole)."""

    index: int
    text: str


ToolDelta: TypeAlias = ContentDelta | ToolCallStart | ToolCallArguments


class ToolCallParser(Protocol):
    """Finds tool calls in one choice's generated text, incrementally."""

    def feed(self, text: str) -> list[ToolDelta]:
        """Take the next piece of generated text; return what it completes."""
        ...

    def finish(self) -> list[ToolDelta]:
        """The text has ended: return whatever was held back."""
        ...


ToolParserFactory: TypeAlias = Callable[[list[dict[str, Any]]], ToolCallParser]
"""``factory(tools)`` -> a parser for one choice; ``tools`` is the request's list, OpenAI-shaped."""


class ToolCall(msgspec.Struct, frozen=True):
    id: str
    name: str
    arguments: str
    """JSON text, as OpenAI's ``function.arguments``."""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def collect(deltas: Iterable[ToolDelta]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole choice: the non-streamed message."""
    content: list[str] = []
    starts: dict[int, ToolCallStart] = {}
    arguments: dict[int, list[str]] = {}
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            content.append(delta.text)
        elif isinstance(delta, ToolCallStart):
            starts[delta.index] = delta
            arguments.setdefault(delta.index, [])
        else:
            arguments.setdefault(delta.index, []).append(delta.text)
    calls = [ToolCall(id=start.id, name=start.name, arguments="".join(arguments[index]))
             for index, start in sorted(starts.items())]
    return "".join(content), calls


# --- the registry ---------------------------------------------------------------------------


class ToolParserNotFound(ValueError):
    """``--tool-call-parser`` names no registered parser; the message lists those that are."""


class ToolParserMissing(InvalidRequest):
    """``tool_choice: "auto"`` with tools, on a server started without ``--tool-call-parser``."""

    code = "tool_call_parser_missing"

    def __init__(self) -> None:
        super().__init__(
            'tool_choice "auto" needs a tool-call parser to find the calls in the model\'s text: start the server '
            "with --tool-call-parser NAME (built in: hermes), or name a function in tool_choice, or use \"required\"",
            param="tool_choice")


def registered_tool_parsers(pm: pluggy.PluginManager) -> dict[str, ToolParserFactory]:
    """Every parser plugins register, by name. A name registered twice raises ``PluginLoadError``
    naming both plugins."""
    from trtserver.plugins import registrations  # plugins -> hookspecs names this module's types

    return {name: registration.factory for name, registration in registrations(pm, "tool_parsers").items()}


def tool_parser_factory(pm: pluggy.PluginManager, name: str) -> ToolParserFactory:
    """The factory ``--tool-call-parser NAME`` selects; ``ToolParserNotFound`` lists the registered names."""
    factories = registered_tool_parsers(pm)
    factory = factories.get(name)
    if factory is None:
        known = ", ".join(sorted(factories)) or "none"
        raise ToolParserNotFound(f"--tool-call-parser {name!r} is not registered; registered parsers: {known}")
    return factory


# --- tool_choice: a named function, or "required" -------------------------------------------


def _functions(tools: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    functions = []
    for tool in tools:
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise InvalidRequest("each tool must be {\"type\": \"function\", \"function\": {...}}", param="tools")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidRequest("each tool's function needs a name", param="tools")
        functions.append(function)
    return functions


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    return copy.deepcopy(dict(parameters)) if parameters else {"type": "object", "properties": {}}


def find_function(tools: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any]:
    """The function ``tool_choice`` names; a 400 naming ``tool_choice`` when ``tools`` lacks it."""
    for function in _functions(tools):
        if function["name"] == name:
            return function
    raise InvalidRequest(f"tool_choice names function {name!r}, which is not among the request's tools",
                         param="tool_choice")


def named_tool_schema(tools: Sequence[Mapping[str, Any]], name: str) -> dict[str, Any]:
    """The JSON schema of the named function's arguments: its ``parameters`` (an empty object when it has none)."""
    return _parameters(find_function(tools, name))


def required_tools_schema(tools: Sequence[Mapping[str, Any]], *, parallel: bool = True) -> dict[str, Any]:
    """A non-empty JSON list of calls, each ``{"name": <one function>, "arguments": <its parameters>}`` (an
    ``anyOf`` over the functions, as vLLM builds it; ``$defs`` move to the top, where their ``$ref``\\ s
    point). With ``parallel`` False the list holds exactly one call."""
    functions = _functions(tools)
    if not functions:
        raise InvalidRequest("tool_choice \"required\" needs at least one tool", param="tools")
    defs: dict[str, Any] = {}
    variants = []
    for function in functions:
        parameters = _parameters(function)
        for def_name, definition in parameters.pop("$defs", {}).items():
            if def_name in defs and defs[def_name] != definition:
                raise InvalidRequest(f"tools define $defs {def_name!r} differently; rename one", param="tools")
            defs[def_name] = definition
        variants.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [function["name"]]}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def calls_from_required_output(text: str) -> list[ToolCall] | None:
    """Tool calls from text generated under :func:`required_tools_schema`; None when it is not such a list
    (generation cut short by ``max_tokens``, say)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        calls.append(ToolCall(id=new_call_id(), name=item["name"], arguments=_json(item.get("arguments", {}))))
    return calls


class NamedToolParser:
    """tool_choice naming one function: all generated text is that call's arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._started = False

    def feed(self, text: str) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        if not self._started:
            self._started = True
            out.append(ToolCallStart(index=0, id=new_call_id(), name=self.name))
        if text:
            out.append(ToolCallArguments(index=0, text=text))
        return out

    def finish(self) -> list[ToolDelta]:
        return [] if self._started else self.feed("")


class RequiredToolParser:
    """tool_choice ``"required"``: the text is a JSON list of ``{"name", "arguments"}``; each call is
    emitted once its object is complete. Text that is not such a list comes back as content at the end."""

    def __init__(self) -> None:
        self._buffer: list[str] = []
        self._item: list[str] = []
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._index = 0
        self._broken = False

    def feed(self, text: str) -> list[ToolDelta]:
        self._buffer.append(text)
        if self._broken:
            return []
        out: list[ToolDelta] = []
        for char in text:
            if self._depth >= 2 or (self._depth == 1 and char == "{"):
                self._item.append(char)
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
                continue
            if char == '"':
                self._in_string = True
            elif char in "[{":
                self._depth += 1
            elif char in "]}":
                self._depth -= 1
                if self._depth == 1 and char == "}":
                    out.extend(self._call("".join(self._item)))
                    self._item = []
        return out

    def _call(self, text: str) -> list[ToolDelta]:
        try:
            item = json.loads(text)
        except ValueError:
            item = None
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            self._broken = True
            return []
        index = self._index
        self._index += 1
        return [ToolCallStart(index=index, id=new_call_id(), name=item["name"]),
                ToolCallArguments(index=index, text=_json(item.get("arguments", {})))]

    def finish(self) -> list[ToolDelta]:
        if self._index == 0 or self._broken:
            text = "".join(self._buffer)
            return [ContentDelta(text)] if text and self._index == 0 else []
        return []
