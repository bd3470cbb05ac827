"""Every bad chat request gets a 4xx in the OpenAI envelope naming the field; and ``tool_choice: "auto"``
on a server started with ``--tool-call-parser hermes``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.http.conftest import MODEL, start_server, stop_server

HI = [{"role": "user", "content": "Hi"}]
OK = {"model": MODEL, "messages": HI, "max_tokens": 2}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALLED = [*HI, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]

# (name, body or raw bytes, status, param, words the message must contain)
CASES: list[tuple[str, object, int, str | None, tuple[str, ...]]] = [
    ("malformed json", b'{"messages": [', 400, None, ()),
    ("not an object", b"[1, 2]", 400, None, ()),
    ("empty body", b"", 400, None, ()),
    ("missing messages", {"model": MODEL}, 400, None, ("messages",)),
    ("messages not a list", {**OK, "messages": "Hi"}, 400, "messages", ()),
    ("empty messages", {**OK, "messages": []}, 400, "messages", ()),
    ("message not an object", {**OK, "messages": ["Hi"]}, 400, "messages", ()),
    ("message without role", {**OK, "messages": [{"content": "Hi"}]}, 400, "messages", ("role",)),
    ("bad role", {**OK, "messages": [{"role": "robot", "content": "Hi"}]}, 400, "messages.role", ("robot",)),
    ("content wrong type", {**OK, "messages": [{"role": "user", "content": 5}]}, 400, "messages.content", ()),
    ("user content null", {**OK, "messages": [{"role": "user", "content": None}]}, 400, "messages", ()),
    ("unknown content part", {**OK, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, 400,
     "messages.content.type", ()),
    ("text part without text", {**OK, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "messages.content", ()),
    ("image_url part", {**OK, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}, 400, "messages",
     ("text", "image_url")),
    ("input_audio part", {**OK, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]}, 400, "messages",
     ("text", "input_audio")),
    ("tool message without tool_call_id", {**OK, "messages": [*CALLED, {"role": "tool", "content": "sunny"}]}, 400,
     "messages", ("tool_call_id",)),
    ("tool_calls on a user message", {**OK, "messages": [{"role": "user", "content": "Hi", "tool_calls": [
        {"id": "call_1", "function": {"name": "f", "arguments": "{}"}}]}]}, 400, "messages", ("assistant",)),
    ("tool call without function", {**OK, "messages": [*HI, {"role": "assistant", "tool_calls": [{"id": "x"}]}]},
     400, "messages.tool_calls", ("function",)),
    ("logprobs not a bool", {**OK, "logprobs": 3}, 400, "logprobs", ()),
    ("top_logprobs without logprobs", {**OK, "top_logprobs": 2}, 400, "top_logprobs", ("logprobs",)),
    ("top_logprobs 21", {**OK, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", ("20",)),
    ("top_logprobs negative", {**OK, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs", ()),
    ("tools not a list", {**OK, "tools": {"name": "f"}}, 400, "tools", ()),
    ("tool without a name", {**OK, "tools": [{"type": "function", "function": {"name": ""}}]}, 400,
     "tools.function.name", ()),
    ("tool of another type", {**OK, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, 400,
     "tools.type", ()),
    ("tool_choice unknown string", {**OK, "tools": [WEATHER], "tool_choice": "sometimes"}, 400, "tool_choice", ()),
    ("tool_choice names an unknown function", {**OK, "tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}}, 400, "tool_choice", ("get_time",)),
    ("tool_choice named without tools", {**OK, "tool_choice": NAMED}, 400, "tool_choice", ()),
    ("tool_choice required without tools", {**OK, "tool_choice": "required"}, 400, "tool_choice", ()),
    ("tool_choice auto without --tool-call-parser", {**OK, "tools": [WEATHER], "tool_choice": "auto"}, 400,
     "tool_choice", ("--tool-call-parser",)),
    ("tools without tool_choice means auto", {**OK, "tools": [WEATHER]}, 400, "tool_choice",
     ("--tool-call-parser",)),
    ("named tool with response_format", {**OK, "tools": [WEATHER], "tool_choice": NAMED,
                                         "response_format": {"type": "json_object"}}, 400, "tool_choice", ()),
    ("continue_final_message with add_generation_prompt", {**OK, "messages": [
        *HI, {"role": "assistant", "content": "Hel"}], "continue_final_message": True}, 400,
     "continue_final_message", ("add_generation_prompt",)),
    ("continue_final_message after a user message", {**OK, "continue_final_message": True,
                                                     "add_generation_prompt": False}, 400,
     "continue_final_message", ("assistant",)),
    ("chat_template_kwargs not an object", {**OK, "chat_template_kwargs": 5}, 400, "chat_template_kwargs", ()),
    ("chat_template_kwargs sets messages", {**OK, "chat_template_kwargs": {"messages": []}}, 400,
     "chat_template_kwargs", ("messages",)),
    ("chat_template_kwargs sets add_generation_prompt", {**OK, "chat_template_kwargs": {
        "add_generation_prompt": False}}, 400, "chat_template_kwargs", ("add_generation_prompt",)),
    ("chat_template syntax error", {**OK, "chat_template": "{% for m in messages %}{{ m.content }}"}, 400,
     "chat_template", ("syntax",)),
    ("chat_template raise_exception", {**OK, "chat_template": "{% if messages[0].role == 'user' %}"
                                       "{{ raise_exception('Conversations must start with a system message') }}"
                                       "{% endif %}"}, 400, "messages",
     ("Conversations must start with a system message",)),
    ("chat_template undefined variable", {**OK, "chat_template": "{{ nothing.here }}"}, 400, "messages",
     ("undefined",)),
    ("chat_template sandbox escape", {**OK, "chat_template": "{{ ''.__class__.__mro__ }}"}, 400, "messages",
     ("unsafe",)),
    ("max_completion_tokens beyond the context", {**OK, "max_completion_tokens": 100000}, 400,
     "max_completion_tokens", ("8192",)),
    ("max_tokens beyond the context", {**OK, "max_tokens": 100000}, 400, "max_tokens", ("8192",)),
    ("max_completion_tokens zero", {**OK, "max_completion_tokens": 0}, 400, "max_completion_tokens", ()),
    ("max_completion_tokens negative", {**OK, "max_completion_tokens": -1}, 400, "max_completion_tokens", ()),
    ("messages beyond the context", {**OK, "messages": [{"role": "user", "content": "hello " * 9000}]}, 400,
     "messages", ("8192",)),
    ("min_tokens over max_tokens", {**OK, "min_tokens": 5}, 400, "min_tokens", ("max_tokens=2",)),
    ("min_tokens over max_completion_tokens", {**OK, "min_tokens": 5, "max_completion_tokens": 3}, 400,
     "min_tokens", ("max_completion_tokens=3",)),
    ("unknown model", {**OK, "model": "gpt-17"}, 404, "model", ("gpt-17",)),
    ("n zero", {**OK, "n": 0}, 400, "n", ()),
    ("temperature too high", {**OK, "temperature": 2.5}, 400, "temperature", ()),
    ("top_p zero", {**OK, "top_p": 0}, 400, "top_p", ()),
    ("stop too many", {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", ()),
    ("stop empty string", {**OK, "stop": [""]}, 400, "stop", ()),
    ("stream_options without stream", {**OK, "stream_options": {"include_usage": True}}, 400, "stream_options", ()),
    ("response_format unknown type", {**OK, "response_format": {"type": "xml"}}, 400, "response_format.type", ()),
    ("logit_bias key not an id", {**OK, "logit_bias": {"hello": 1}}, 400, "logit_bias", ()),
    ("seed too large", {**OK, "seed": 2**70}, 400, "seed", ()),
    ("service_tier unknown", {**OK, "service_tier": "gold"}, 400, "service_tier", ()),
    ("parallel_tool_calls not a bool", {**OK, "parallel_tool_calls": "yes"}, 400, "parallel_tool_calls", ()),
    ("extra_body not an object", {**OK, "extra_body": 5}, 400, "extra_body", ()),
]


def post(http: httpx.Client, body: object) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    return http.post("/v1/chat/completions", json=body)


@pytest.mark.parametrize("name, body, status, param, words", CASES, ids=[c[0] for c in CASES])
def test_bad_request(http: httpx.Client, name: str, body: object, status: int, param: str | None,
                     words: tuple[str, ...]) -> None:
    response = post(http, body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["param"] == param, error
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    for word in words:
        assert word.lower() in error["message"].lower(), error


@pytest.mark.parametrize("body, param", [
    ({**OK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format"),
    ({**OK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
], ids=["response_format schema", "named tool parameters"])
def test_uncompilable_schema_names_its_field(http: httpx.Client, body: dict[str, object], param: str) -> None:
    response = post(http, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_streamed_bad_request_is_an_error_before_the_stream(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={**OK, "stream": True, "top_logprobs": 2})
    assert response.status_code == 400 and response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["param"] == "top_logprobs"


def test_server_still_serves_after_bad_requests(http: httpx.Client) -> None:
    for _name, body, _status, _param, _words in CASES:
        post(http, body)
    response = http.post("/v1/chat/completions", json=OK)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"]


# --- tool_choice "auto" with --tool-call-parser hermes ------------------------------------------------------

# the 135M model does not write tool calls by itself: guided decoding makes it write one in the Hermes format,
# which the parser then has to find in the generated text
HERMES_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,10}"\}\}</tool_call>'
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def hermes(engine_dir: Path) -> Iterator[httpx.Client]:
    process, base = start_server(engine_dir, "--tool-call-parser", "hermes", log_name="hermes")
    try:
        with httpx.Client(base_url=base, timeout=300) as http:
            yield http
    finally:
        stop_server(process)


def test_auto_finds_a_hermes_call_in_the_text(hermes: httpx.Client) -> None:
    # seeded: the streamed repeat takes no cached prefix, whose shorter prefill may round a near tie apart
    body = {"model": MODEL, "messages": WEATHER_QUESTION, "tools": [WEATHER], "tool_choice": "auto",
            "max_tokens": 64, "temperature": 0, "seed": 0, "guided_regex": HERMES_CALL}
    choice = hermes.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) == {"city"} and arguments["city"][:1].isupper()

    with hermes.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        payloads = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    deltas = [json.loads(p)["choices"][0] for p in payloads[:-1]]
    calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert "".join(c["function"].get("arguments", "") for c in calls) == call["function"]["arguments"]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == ""  # the tag is no content
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_auto_passes_plain_text_through(hermes: httpx.Client) -> None:
    """When the model answers in words, auto returns exactly the text "none" returns (this model's template
    does not render tools, so both prompts are the same)."""
    # one server, idle between the two (a busier batch takes other kernels); seeded, so the second does not take
    # the first's prompt from the prefix cache: a cached prefix can round apart and move a near-tie
    body = {"model": MODEL, "messages": WEATHER_QUESTION, "tools": [WEATHER], "max_tokens": 12, "temperature": 0,
            "seed": 0}
    auto = hermes.post("/v1/chat/completions", json={**body, "tool_choice": "auto"}).json()
    none = hermes.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).json()
    assert "<tool_call>" not in none["choices"][0]["message"]["content"]
    assert auto["choices"][0]["message"] == none["choices"][0]["message"]
    assert auto["choices"][0]["finish_reason"] == none["choices"][0]["finish_reason"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens is the prefix cache's business
    assert {k: auto["usage"][k] for k in counts} == {k: none["usage"][k] for k in counts}
