"""vLLM's ``/tokenize`` (a prompt, or messages through the chat template) and ``/detokenize``."""

from __future__ import annotations

import httpx
import pytest

from tests.http.conftest import MODEL

TEXT = "Hello, world! Ünïcödé and 12345."
HI = [{"role": "user", "content": "Hi"}]


def tokenize(http: httpx.Client, **body: object) -> dict:
    response = http.post("/tokenize", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def detokenize(http: httpx.Client, tokens: list[int]) -> str:
    response = http.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert response.status_code == 200, response.text
    return str(response.json()["prompt"])


def test_prompt_round_trip_and_token_strings(http: httpx.Client) -> None:
    body = tokenize(http, prompt=TEXT, return_token_strs=True)
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) and body["max_model_len"] == 8192
    assert body["token_strs"][:4] == ["Hello", ",", "Ġworld", "!"]  # the tokenizer's own (byte-level) strings
    assert detokenize(http, body["tokens"]) == TEXT
    assert tokenize(http, prompt=TEXT)["token_strs"] is None
    completion = http.post("/v1/completions", json={"model": MODEL, "prompt": TEXT, "max_tokens": 1,
                                                    "temperature": 0, "return_token_ids": True}).json()
    assert completion["choices"][0]["prompt_token_ids"] == body["tokens"]


def test_messages_through_the_template(http: httpx.Client) -> None:
    body = tokenize(http, messages=HI, return_token_strs=True)
    text = detokenize(http, body["tokens"])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\nHi<|im_end|>\n"
                                                                     "<|im_start|>assistant\n")
    assert body["token_strs"][0] == "<|im_start|>" and body["token_strs"].count("<|im_start|>") == 3  # special
    assert body["token_strs"].count("<|im_end|>") == 2
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == body["count"]

    bare = tokenize(http, messages=HI, add_generation_prompt=False)
    assert detokenize(http, bare["tokens"]) == text[:-len("<|im_start|>assistant\n")]
    assert body["tokens"][:bare["count"]] == bare["tokens"]


def test_continue_final_message(http: httpx.Client) -> None:
    messages = [*HI, {"role": "assistant", "content": "The capital of France is"}]
    body = tokenize(http, messages=messages, add_generation_prompt=False, continue_final_message=True)
    assert detokenize(http, body["tokens"]).endswith("<|im_start|>assistant\nThe capital of France is")


def test_per_request_template_and_kwargs(http: httpx.Client) -> None:
    template = "{% for m in messages %}[{{ m.role }}|{{ greeting }}] {{ m.content }}\n{% endfor %}"
    body = tokenize(http, messages=HI, chat_template=template, chat_template_kwargs={"greeting": "hey"})
    assert detokenize(http, body["tokens"]) == "[user|hey] Hi\n"


def test_detokenize_keeps_special_tokens_and_empty_lists(http: httpx.Client) -> None:
    ids = tokenize(http, messages=HI)["tokens"]
    assert detokenize(http, ids[:2]) == "<|im_start|>system"
    assert detokenize(http, []) == ""


TOKENIZE_CASES: list[tuple[str, object, int, str | None]] = [
    ("neither prompt nor messages", {}, 400, "prompt"),
    ("both prompt and messages", {"prompt": "x", "messages": HI}, 400, "prompt"),
    ("prompt wrong type", {"prompt": 5}, 400, "prompt"),
    ("bad role", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.role"),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages"),
    ("tool message without id", {"messages": [*HI, {"role": "tool", "content": "x"}]}, 400, "messages"),
    ("template syntax error", {"messages": HI, "chat_template": "{% if %}"}, 400, "chat_template"),
    ("template raises", {"messages": HI, "chat_template": "{{ raise_exception('no') }}"}, 400, "messages"),
    ("reserved kwarg", {"messages": HI, "chat_template_kwargs": {"tools": []}}, 400, "chat_template_kwargs"),
    ("continue with generation prompt", {"messages": [*HI, {"role": "assistant", "content": "x"}],
                                         "continue_final_message": True}, 400, "continue_final_message"),
    ("unknown model", {"prompt": "x", "model": "gpt-17"}, 404, "model"),
    ("not an object", b"[1]", 400, None),
    ("malformed json", b'{"prompt": ', 400, None),
]
DETOKENIZE_CASES: list[tuple[str, object, int, str | None]] = [
    ("negative id", {"tokens": [-1]}, 400, "tokens"),
    ("id past the vocabulary", {"tokens": [49152]}, 400, "tokens"),
    ("tokens not a list", {"tokens": "abc"}, 400, "tokens"),
    ("token not an int", {"tokens": [1.5]}, 400, "tokens"),
    ("unknown model", {"tokens": [1], "model": "gpt-17"}, 404, "model"),
    ("not an object", b"[1]", 400, None),
    ("malformed json", b'{"tokens": [', 400, None),
]


@pytest.mark.parametrize("route, name, body, status, param",
                         [("/tokenize", *c) for c in TOKENIZE_CASES] + [("/detokenize", *c) for c in DETOKENIZE_CASES],
                         ids=[f"tokenize {c[0]}" for c in TOKENIZE_CASES] +
                             [f"detokenize {c[0]}" for c in DETOKENIZE_CASES])
def test_bad_request(http: httpx.Client, route: str, name: str, body: object, status: int,
                     param: str | None) -> None:
    if isinstance(body, bytes):
        response = http.post(route, content=body, headers={"Content-Type": "application/json"})
    else:
        response = http.post(route, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error


def test_wrong_content_type_is_415(http: httpx.Client) -> None:
    for route in ("/tokenize", "/detokenize"):
        response = http.post(route, content=b"prompt=x", headers={"Content-Type": "text/plain"})
        assert response.status_code == 415, route
