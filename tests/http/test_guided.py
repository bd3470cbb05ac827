"""Guided decoding end to end: request fields -> the guided plugin -> the engine -> a parsable answer."""

from __future__ import annotations

import json
import re

import httpx
from openai import OpenAI

from tests.http.conftest import MODEL

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "is_capital": {"type": "boolean"}},
          "required": ["city", "is_capital"], "additionalProperties": False}


def post(http: httpx.Client, **body: object) -> dict:
    response = http.post("/v1/completions", json={"model": MODEL, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_guided_choice_and_regex(http: httpx.Client) -> None:
    choice = post(http, prompt="Is Paris in France? Answer:", max_tokens=8, guided_choice=["yes", "no"])
    assert choice["text"] in ("yes", "no") and choice["finish_reason"] == "stop"
    regex = post(http, prompt="The year the Eiffel Tower opened:", max_tokens=8, guided_regex=r"1[0-9]{3}")
    assert re.fullmatch(r"1[0-9]{3}", regex["text"]) and regex["finish_reason"] == "stop"


def test_json_schema_through_the_openai_sdk(client: OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL, prompt="A JSON object describing Paris:", max_tokens=40, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}})
    data = json.loads(completion.choices[0].text)
    assert set(data) == {"city", "is_capital"} and isinstance(data["is_capital"], bool)
    assert completion.choices[0].finish_reason == "stop"


def test_structured_outputs_with_another_backend(http: httpx.Client) -> None:
    choice = post(http, prompt="Pick a colour:", max_tokens=8,
                  structured_outputs={"choice": ["red", "green", "blue"], "backend": "llguidance"})
    assert choice["text"] in ("red", "green", "blue")


def test_streamed_guided_text_matches(http: httpx.Client) -> None:
    # seeded: neither takes a cached prefix, whose shorter prefill may round a near tie apart
    body = {"model": MODEL, "prompt": "The year the Eiffel Tower opened:", "max_tokens": 8, "temperature": 0,
            "seed": 0, "guided_regex": r"1[0-9]{3}"}
    full = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    text = ""
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    assert text == full


def test_backend_that_cannot_do_grammars_is_a_400(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_grammar": 'root ::= "a"',
            "guided_decoding_backend": "outlines"}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert "outlines" in response.json()["error"]["message"]
