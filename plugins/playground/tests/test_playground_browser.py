"""The page in headless Chromium against a real server on the default model."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import httpx
import pytest
from playground_support import MODEL, Page, metric
from selenium.webdriver.common.action_chains import ActionChains

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "enum": ["Ada", "Bob"]},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


def assert_grew_over_frames(frames: list[int], final: str) -> None:
    """The answer appeared piece by piece: several distinct lengths, never shrinking, ending at the full text."""
    assert frames == sorted(frames), frames
    lengths = sorted(set(frames) - {0})
    assert len(lengths) >= 3, frames
    assert lengths[-1] == len(final)


def server_answer(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{base}{path}", json=body, timeout=180)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_page_loads_without_console_errors(page: Page, base_url: str) -> None:
    page.open()
    card = httpx.get(f"{base_url}/v1/models").json()["data"][0]
    assert page.text("model-id") == MODEL
    assert page.text("model-context") == f"{card['max_model_len']} tokens"
    page.wait(lambda d: page.text("metric-running") != "–", 10)
    assert page.text("metric-running") == "0" and page.text("metric-queue") == "0"
    assert page.text("metric-kv").endswith("/4")
    assert page.text("status") == ""
    # every file the page loaded came from this server
    resources = page.js("return performance.getEntriesByType('resource').map(e => e.name)")
    assert resources and all(url.startswith(base_url + "/") for url in resources), resources
    page.screenshot("01-loaded")
    assert page.console_errors() == []


def test_completion_streams_token_by_token(page: Page, base_url: str) -> None:
    page.open()
    page.mode("completion")
    page.fill("prompt", "Once upon a time")
    page.fill("max_tokens", "16")
    page.fill("temperature", "0")
    page.fill("seed", "0")  # seeded, as the reference below: neither takes a cached prefix that may round apart
    page.record_frames()
    page.send()
    page.wait(lambda d: len(page.answer()) > 0, 60)
    page.screenshot("02-completion-streaming")
    assert page.wait_done().startswith("Done")
    text = page.answer()
    assert_grew_over_frames(page.frames(), text)
    expected = server_answer(base_url, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 16,
                                                           "temperature": 0, "seed": 0})
    assert text == expected["choices"][0]["text"]
    assert page.text("stat-completion") == str(expected["usage"]["completion_tokens"])
    assert page.text("stat-prompt") == str(expected["usage"]["prompt_tokens"])
    assert page.text("stat-ttft").endswith("s") and float(page.text("stat-tps")) > 0
    assert page.text("model-fingerprint") == expected["system_fingerprint"]
    page.screenshot("03-completion-done")
    assert page.console_errors() == []


def test_chat_streams_token_by_token(page: Page, base_url: str) -> None:
    page.open()
    page.mode("chat")
    question = "Name one colour of the sky."
    page.fill("prompt", question)
    page.fill("max_tokens", "16")
    page.fill("temperature", "0")
    page.fill("seed", "0")  # seeded, as the reference below: neither takes a cached prefix that may round apart
    page.record_frames()
    page.send()
    page.wait(lambda d: len(page.answer()) > 0, 60)
    page.screenshot("04-chat-streaming")
    assert page.wait_done().startswith("Done"), page.text("status")
    text = page.answer()
    assert_grew_over_frames(page.frames(), text)
    expected = server_answer(base_url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": question}], "max_tokens": 16, "temperature": 0, "seed": 0})
    assert expected["object"] == "chat.completion"
    assert text == expected["choices"][0]["message"]["content"]
    assert page.text("stat-completion") == str(expected["usage"]["completion_tokens"])
    assert page.js("return [...document.querySelectorAll('#transcript .message.user')].map(e => e.textContent)") \
        == [question]
    page.screenshot("05-chat-done")
    assert page.console_errors() == []


def test_stop_aborts_and_the_server_frees_the_slot(page: Page, base_url: str) -> None:
    page.open()
    page.mode("completion")
    page.fill("prompt", "1, 2, 3, 4, 5, 6,")
    page.fill("max_tokens", "400")
    page.fill("temperature", "0")
    gone = 'endpoint="completions",status="499",tier="auto"'  # a request whose client went away
    aborted = metric(base_url, "trtserver_requests_total", gone)
    page.send()
    page.wait(lambda d: len(page.answer()) > 3, 60)
    assert metric(base_url, "trtserver_running_sequences") == 1
    page.el("stop-button").click()
    assert page.wait_done(10).startswith("Stopped")
    deadline = time.monotonic() + 5
    while metric(base_url, "trtserver_running_sequences") != 0:
        assert time.monotonic() < deadline, "the server still runs the stopped request"
        time.sleep(0.1)
    assert metric(base_url, "trtserver_requests_total", gone) == aborted + 1
    stopped_at = page.answer()
    assert 0 < len(stopped_at) and page.text("stat-finish") == "–"
    page.wait(lambda d: page.text("metric-running") == "0", 5)
    time.sleep(1)
    assert page.answer() == stopped_at
    assert int(page.text("stat-completion")) < 400
    page.screenshot("06-stopped")
    assert page.console_errors() == []


def structured(page: Page, schema: dict[str, Any]) -> None:
    page.tab("structured")
    page.js("document.getElementById('guide-kind').value = 'json'")
    page.fill("guide-spec", json.dumps(schema, indent=2))
    page.js("document.getElementById('guide-backend').value = 'xgrammar'")


@pytest.mark.parametrize("mode", ["completion", "chat"])
def test_json_schema_shows_valid_json(page: Page, mode: str) -> None:
    page.open()
    page.mode(mode)
    page.fill("prompt", "A person, as JSON:" if mode == "completion" else "Describe a person as JSON.")
    page.fill("max_tokens", "48")
    page.fill("temperature", "0")
    structured(page, PERSON)
    page.send()
    assert page.wait_done(180).startswith("Done"), page.text("status")
    value = json.loads(page.answer())
    assert value["name"] in ("Ada", "Bob") and 0 <= value["age"] <= 120 and set(value) == {"name", "age"}
    assert page.js("return document.querySelector('#output .check').textContent") == "valid JSON"
    page.screenshot(f"07-json-schema-{mode}")
    page.tab("sampling")
    assert page.console_errors() == []


@pytest.mark.parametrize("mode", ["completion", "chat"])
def test_logprobs_view_one_coloured_span_per_token(page: Page, base_url: str, mode: str) -> None:
    prompt = "The capital of France is" if mode == "completion" else "What is the capital of France?"
    page.open()
    page.mode(mode)
    page.fill("prompt", prompt)
    page.fill("max_tokens", "10")
    page.fill("temperature", "0")
    page.fill("seed", "0")  # seeded, as the reference below: neither takes a cached prefix that may round apart
    page.check("logprobs")
    page.fill("top_logprobs", "3")
    page.send()
    assert page.wait_done().startswith("Done"), page.text("status")
    page.el("view-tokens").click()
    spans = page.js("return [...document.querySelectorAll('#output .tok')].map(s => ({text: s.textContent, "
                    "p: Number(s.dataset.p), colour: s.style.backgroundColor, "
                    "alternatives: JSON.parse(s.dataset.alternatives)}))")
    if mode == "completion":
        choice = server_answer(base_url, "/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0,
                                                             "seed": 0, "logprobs": 3})["choices"][0]
        tokens = list(zip(choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]))
    else:
        choice = server_answer(base_url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": prompt}], "max_tokens": 10, "temperature": 0, "seed": 0,
            "logprobs": True, "top_logprobs": 3})["choices"][0]
        tokens = [(t["token"], t["logprob"]) for t in choice["logprobs"]["content"]]
    # one span per token the server reported, in order, each with its probability
    assert [s["text"] for s in spans] == [token for token, _ in tokens] and spans
    assert "".join(s["text"] for s in spans) == page.answer()
    for span, (_, logprob) in zip(spans, tokens):
        # a margin for rounding between two requests where activations are rounded to bfloat16 (bfloat16 models,
        # int4 projections); seeded, neither takes a cached prefix
        assert math.isclose(span["p"], math.exp(logprob), rel_tol=5e-2, abs_tol=1e-3), span
        assert span["colour"].startswith("rgb")
        assert 1 <= len(span["alternatives"]) <= 3
        best = max(lp for _, lp in span["alternatives"])
        # temperature 0: the chosen token is the most likely one
        assert math.isclose(span["p"], math.exp(best), rel_tol=1e-3, abs_tol=5e-5), span  # p has 4 decimals
    assert len({s["colour"] for s in spans}) > 1  # coloured by probability, not one colour for all
    first = page.driver.find_elements("css selector", "#output .tok")[0]
    ActionChains(page.driver).move_to_element(first).perform()
    page.wait(lambda d: page.el("tooltip").is_displayed(), 5)
    assert len(page.text("tooltip")) > 0
    page.screenshot(f"08-logprobs-{mode}")
    page.el("view-text").click()
    assert page.console_errors() == []
