"""The chat API on the real model, as the official openai SDK uses it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

from tests.http.conftest import LOGPROB_TOLERANCE, MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": WEATHER_PARAMETERS}}
TIME_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                         "parameters": TIME_PARAMETERS}}
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}


def create(client: OpenAI, **kwargs: object):  # type: ignore[no-untyped-def]
    return client.chat.completions.create(model=MODEL, **kwargs)  # type: ignore[call-overload]


def sse(http: httpx.Client, body: dict[str, object]) -> list[str]:
    """The ``data:`` payloads of a streamed chat request, in order (``[DONE]`` included)."""
    with http.stream("POST", "/v1/chat/completions", json={"model": MODEL, "stream": True, **body}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


# --- plain, streamed, n -------------------------------------------------------------------------


def test_plain_completion(client: OpenAI) -> None:
    response = create(client, messages=QUESTION, max_tokens=8, temperature=0)
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert response.model == MODEL and response.system_fingerprint
    (choice,) = response.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert "Paris" in (choice.message.content or "")
    assert choice.message.refusal is None and choice.message.tool_calls is None and choice.logprobs is None
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage is not None and 0 < usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_stream_role_first_finish_last_and_usage_chunk(client: OpenAI) -> None:
    # seeded: neither takes a cached prefix, which may round a near tie apart and would change cached_tokens
    whole = create(client, messages=QUESTION, max_tokens=8, temperature=0, seed=0)
    chunks = list(create(client, messages=QUESTION, max_tokens=8, temperature=0, seed=0, stream=True,
                         stream_options={"include_usage": True}))
    *parts, usage_chunk = chunks
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage
    assert all(c.usage is None for c in parts) and all(len(c.choices) == 1 for c in parts)
    deltas = [c.choices[0] for c in parts]
    assert deltas[0].delta.role == "assistant"
    assert all(d.delta.role is None for d in deltas[1:])
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert deltas[-1].finish_reason == whole.choices[0].finish_reason
    assert "".join(d.delta.content or "" for d in deltas) == whole.choices[0].message.content


def test_stream_ends_with_done_and_sends_no_usage_unasked(http: httpx.Client) -> None:
    payloads = sse(http, {"messages": QUESTION, "max_tokens": 3, "temperature": 0})
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["choices"] and c["usage"] is None for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_n_two_streamed_per_choice(client: OpenAI) -> None:
    chunks = list(create(client, messages=QUESTION, max_tokens=5, temperature=1.0, seed=7, n=2, stream=True,
                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10
    for index in (0, 1):
        deltas = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == index]
        assert deltas[0].delta.role == "assistant" and all(d.delta.role is None for d in deltas[1:])
        assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]
    whole = create(client, messages=QUESTION, max_tokens=5, temperature=1.0, seed=7, n=2,
                   extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.usage is not None and whole.usage.completion_tokens == 10


# --- logprobs, response_format ------------------------------------------------------------------


def test_logprobs_content_joins_to_the_content(client: OpenAI) -> None:
    response = create(client, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    choice = response.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    entries = choice.logprobs.content
    assert "".join(e.token for e in entries) == choice.message.content
    assert b"".join(bytes(e.bytes or []) for e in entries).decode() == choice.message.content
    for entry in entries:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        best = entry.top_logprobs[0]
        assert best.token == entry.token  # greedy: the chosen token is the most likely
        assert math.isclose(best.logprob, entry.logprob, abs_tol=LOGPROB_TOLERANCE)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
    plain = create(client, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True)
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.content
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)


def test_response_format_json_schema(client: OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "is_capital": {"type": "boolean"}},
              "required": ["city", "is_capital"], "additionalProperties": False}
    response = create(client, messages=[{"role": "user", "content": "Describe Paris as JSON."}], max_tokens=40,
                      temperature=0, response_format={"type": "json_schema",
                                                      "json_schema": {"name": "city", "schema": schema}})
    choice = response.choices[0]
    jsonschema.validate(json.loads(choice.message.content or ""), schema)
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None


# --- tools ----------------------------------------------------------------------------------------


def test_named_tool_choice(client: OpenAI) -> None:
    response = create(client, messages=WEATHER_QUESTION, max_tokens=40, temperature=0, tools=[WEATHER],
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.id.startswith("call_") and len(call.id) > len("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)


def test_named_tool_choice_streamed_one_entry_per_call_per_delta(http: httpx.Client) -> None:
    # seeded: neither request takes a cached prefix, whose shorter prefill may round a near tie apart
    body = {"messages": WEATHER_QUESTION, "max_tokens": 40, "temperature": 0, "seed": 0, "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    chunks = [json.loads(p) for p in sse(http, body)[:-1]]
    deltas = [c["choices"][0] for c in chunks]
    calls = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
    for d in deltas:  # clients (LangChain, the SDK's stream helpers) merge a call's fragments by index
        indexes = [call["index"] for call in d["delta"].get("tool_calls", [])]
        assert len(indexes) == len(set(indexes)), d
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert calls[0]["function"]["name"] == "get_weather"
    assert all("id" not in call and "name" not in call["function"] for call in calls[1:])
    arguments = "".join(call["function"].get("arguments", "") for call in calls)
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)
    assert [d["finish_reason"] for d in deltas] == [None] * (len(deltas) - 1) + ["tool_calls"]
    assert all(d["delta"].get("content") in (None, "") for d in deltas)
    whole = http.post("/v1/chat/completions", json={"model": MODEL, **body}).json()
    assert whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == arguments


def test_tool_choice_required(client: OpenAI) -> None:
    response = create(client, messages=WEATHER_QUESTION, max_tokens=48, temperature=0, tools=[WEATHER, TIME],
                      tool_choice="required", parallel_tool_calls=False)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.id.startswith("call_") and call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_none_answers_in_text(client: OpenAI) -> None:
    response = create(client, messages=QUESTION, max_tokens=6, temperature=0, tools=[WEATHER], tool_choice="none")
    choice = response.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_multi_turn_with_tool_calls_and_results(client: OpenAI, http: httpx.Client) -> None:
    messages = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc123", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc123", "content": "22 degrees and sunny"},
    ]
    response = create(client, messages=messages, max_tokens=8, temperature=0, tools=[WEATHER], tool_choice="none")
    assert response.choices[0].message.content
    tokenized = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert response.usage is not None and response.usage.prompt_tokens == tokenized["count"]
    prompt = http.post("/detokenize", json={"model": MODEL, "tokens": tokenized["tokens"]}).json()["prompt"]
    assert "22 degrees and sunny<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")


# --- sampling, stops, limits ----------------------------------------------------------------------


def test_seed_reproducible(client: OpenAI) -> None:
    def sample(seed: int) -> list[str | None]:
        response = create(client, messages=QUESTION, max_tokens=8, temperature=1.0, seed=seed, n=2)
        return [c.message.content for c in response.choices]

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_stop_strings(client: OpenAI) -> None:
    # seeded: neither takes a cached prefix, whose shorter prefill may round a near tie apart
    full = create(client, messages=QUESTION, max_tokens=10, temperature=0, seed=0).choices[0].message.content or ""
    stop = " " + full.split()[2]  # the third word, with its leading space
    assert stop in full
    response = create(client, messages=QUESTION, max_tokens=10, temperature=0, seed=0, stop=[stop, "zzz"])
    choice = response.choices[0]
    assert choice.message.content == full[:full.index(stop)]
    assert choice.finish_reason == "stop" and (choice.model_extra or {}).get("stop_reason") == stop


def test_max_completion_tokens(client: OpenAI) -> None:
    response = create(client, messages=QUESTION, max_completion_tokens=3, max_tokens=10, temperature=0,
                      extra_body={"ignore_eos": True})
    assert response.usage is not None and response.usage.completion_tokens == 3
    assert response.choices[0].finish_reason == "length"


# --- models ---------------------------------------------------------------------------------------


def test_models_retrieve(client: OpenAI) -> None:
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    assert (model.model_extra or {}).get("max_model_len") == 8192
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("gpt-17")
    error = raised.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == "model" and "gpt-17" in error["message"]


# --- the same prompt through both APIs ------------------------------------------------------------


def test_chat_and_templated_completion_agree(http: httpx.Client, engine_dir: Path) -> None:
    """transformers' own rendering of the model's template, sent to /v1/completions, gives the same prompt
    tokens and the same greedy text as the messages sent to chat."""
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "You are terse."}, *QUESTION,
                {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]
    tokenizer = AutoTokenizer.from_pretrained(str(engine_dir))
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    reference_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    tokenized = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert tokenized["tokens"] == reference_ids
    # seeded: no request takes a cached prefix, whose shorter prefill may round a near tie apart
    completion = http.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 12,
                                                    "temperature": 0, "seed": 0, "return_token_ids": True}).json()
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 12,
                                                   "temperature": 0, "seed": 0}).json()
    assert completion["choices"][0]["prompt_token_ids"] == reference_ids
    assert chat["usage"]["prompt_tokens"] == len(reference_ids) == completion["usage"]["prompt_tokens"]
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    assert chat["choices"][0]["finish_reason"] == completion["choices"][0]["finish_reason"]
    by_ids = http.post("/v1/completions", json={"model": MODEL, "prompt": tokenized["tokens"], "max_tokens": 12,
                                                "temperature": 0, "seed": 0}).json()
    assert by_ids["choices"][0]["text"] == completion["choices"][0]["text"]
