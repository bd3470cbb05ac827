"""The ``hermes`` tool-call parser: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The format of Hermes 2 Pro / 3 and Qwen 2.5 / 3 chat templates. Content outside the tags streams
through as it comes, except a trailing piece that could be the start of ``<tool_call>``, and
whitespace, which waits for the text after it: whitespace just before or after a call is dropped
(the newlines between calls are no content). A call is emitted when its ``</tool_call>`` arrives,
or at the end of the text when the model stopped before closing the last one. A tag whose body is
not a JSON object with a ``name`` is given back as content, exactly as generated.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from trtserver.hookspecs import hookimpl
from trtserver.tool_calls import (
    ContentDelta,
    ToolCallArguments,
    ToolCallParser,
    ToolCallStart,
    ToolDelta,
    new_call_id,
)

START = "<tool_call>"
END = "</tool_call>"


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class HermesToolParser:
    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []
        self._buffer = ""
        self._in_call = False
        self._space = ""  # whitespace that waits to see what follows it
        self._space_before_call = ""  # given back with the tag if the call turns out malformed
        self._calls = 0

    def feed(self, text: str) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        if not self._buffer and not self._in_call and "<" not in text:  # the common case: plain content
            self._content(text, out)
            return out
        self._buffer += text
        while True:
            if self._in_call:
                at = self._buffer.find(END)
                if at < 0:
                    return out
                body, self._buffer = self._buffer[:at], self._buffer[at + len(END):]
                self._in_call = False
                out.extend(self._call(body, closed=True))
                continue
            at = self._buffer.find(START)
            if at >= 0:
                self._content(self._buffer[:at], out)
                self._space_before_call, self._space = self._space, ""
                self._buffer = self._buffer[at + len(START):]
                self._in_call = True
                continue
            keep = _held_prefix(self._buffer, START)
            self._content(self._buffer[:len(self._buffer) - keep], out)
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return out

    def finish(self) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        if self._in_call:
            out.extend(self._call(self._buffer, closed=False))
        else:
            self._content(self._buffer, out)
        self._buffer = ""
        self._in_call = False
        if self._space and self._calls == 0:
            out.append(ContentDelta(self._space))
        self._space = ""
        return out

    def _content(self, text: str, out: list[ToolDelta]) -> None:
        if not text:
            return
        text = self._space + text
        kept = text.rstrip()
        self._space = text[len(kept):]
        if kept:
            out.append(ContentDelta(kept))

    def _call(self, body: str, *, closed: bool) -> list[ToolDelta]:
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        name = call.get("name") if isinstance(call, dict) else None
        arguments = call.get("arguments", call.get("parameters", {})) if isinstance(call, dict) else None
        if not isinstance(name, str) or not name or not isinstance(arguments, dict | str):
            malformed: list[ToolDelta] = []
            self._space = self._space_before_call
            self._content(START + body + (END if closed else ""), malformed)
            return malformed
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        index = self._calls
        self._calls += 1
        return [ToolCallStart(index=index, id=new_call_id(), name=name), ToolCallArguments(index=index, text=arguments)]


@hookimpl
def trtserver_register_tool_parsers(register: Callable[[str, Callable[[list[dict[str, Any]]], ToolCallParser]], None],
                                    ) -> None:
    register("hermes", HermesToolParser)
