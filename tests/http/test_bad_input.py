"""Every bad request gets a 4xx in the OpenAI envelope naming the field, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from tests.http.conftest import MODEL

OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}

# (name, body or raw bytes, status, param)
CASES: list[tuple[str, object, int, str | None]] = [
    ("malformed json", b'{"prompt": "x",', 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("empty body", b"", 400, None),
    ("missing prompt", {"model": MODEL}, 400, None),
    ("prompt wrong type", {**OK, "prompt": 5}, 400, "prompt"),
    ("prompt empty list", {**OK, "prompt": []}, 400, "prompt"),
    ("prompt mixed", {**OK, "prompt": ["a", 1]}, 400, "prompt"),
    ("prompt negative id", {**OK, "prompt": [-3]}, 400, "prompt"),
    ("prompt id past vocab", {**OK, "prompt": [10**6]}, 400, "prompt"),
    ("prompt over context", {**OK, "prompt": [1] * 8192}, 400, "prompt"),
    ("prompt empty token list", {**OK, "prompt": [[1], []]}, 400, "prompt"),
    ("unknown model", {**OK, "model": "gpt-17"}, 404, "model"),
    ("temperature too high", {**OK, "temperature": 2.1}, 400, "temperature"),
    ("temperature negative", {**OK, "temperature": -0.1}, 400, "temperature"),
    ("temperature string", {**OK, "temperature": "hot"}, 400, "temperature"),
    ("top_p zero", {**OK, "top_p": 0}, 400, "top_p"),
    ("top_p above one", {**OK, "top_p": 1.5}, 400, "top_p"),
    ("top_k below -1", {**OK, "top_k": -2}, 400, "top_k"),
    ("min_p above one", {**OK, "min_p": 1.2}, 400, "min_p"),
    ("max_tokens negative", {**OK, "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens float", {**OK, "max_tokens": 1.5}, 400, "max_tokens"),
    ("max_tokens zero without echo", {**OK, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens over context", {**OK, "max_tokens": 100000}, 400, "max_tokens"),
    ("n zero", {**OK, "n": 0}, 400, "n"),
    ("n over limit", {**OK, "n": 129}, 400, "n"),
    ("best_of below n", {**OK, "n": 3, "best_of": 2}, 400, "best_of"),
    ("best_of streamed", {**OK, "best_of": 2, "stream": True}, 400, "best_of"),
    ("best_of over limit", {**OK, "best_of": 21}, 400, "best_of"),
    ("logprobs over 5", {**OK, "logprobs": 6}, 400, "logprobs"),
    ("logprobs negative", {**OK, "logprobs": -1}, 400, "logprobs"),
    ("frequency_penalty", {**OK, "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ("presence_penalty", {**OK, "presence_penalty": -2.5}, 400, "presence_penalty"),
    ("repetition_penalty zero", {**OK, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("logit_bias key not int", {**OK, "logit_bias": {"hello": 1}}, 400, "logit_bias"),
    ("logit_bias value", {**OK, "logit_bias": {"5": 150}}, 400, "logit_bias"),
    ("logit_bias id past vocab", {**OK, "logit_bias": {"999999": 5}}, 400, "logit_bias"),
    ("stop too many", {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("stop empty string", {**OK, "stop": [""]}, 400, "stop"),
    ("stop wrong type", {**OK, "stop": 5}, 400, "stop"),
    ("stop_token_ids past vocab", {**OK, "stop_token_ids": [999999]}, 400, "stop_token_ids"),
    ("stop_token_ids the whole vocabulary", {**OK, "stop_token_ids": list(range(49152))}, 400, "stop_token_ids"),
    ("stop string too long", {**OK, "stop": "Z" * 300000}, 400, "stop"),
    ("length_penalty huge", {**OK, "use_beam_search": True, "n": 2, "length_penalty": 1e308}, 400,
     "length_penalty"),
    ("length_penalty very negative", {**OK, "use_beam_search": True, "n": 2, "length_penalty": -1000}, 400,
     "length_penalty"),
    ("prompt bytes beyond any context", {**OK, "prompt": "word " * 2_000_000}, 400, "prompt"),
    ("stream_options without stream", {**OK, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("min_tokens over max_tokens", {**OK, "min_tokens": 5}, 400, "min_tokens"),
    ("seed too large", {**OK, "seed": 2**70}, 400, "seed"),
    ("service_tier unknown", {**OK, "service_tier": "gold"}, 400, "service_tier"),
    ("suffix without FIM", {**OK, "suffix": "end"}, 400, "suffix"),
    ("echo wrong type", {**OK, "echo": "yes"}, 400, "echo"),
    ("allowed_token_ids empty", {**OK, "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("beam search streamed", {**OK, "use_beam_search": True, "stream": True}, 400, "use_beam_search"),
    ("early_stopping bad", {**OK, "early_stopping": "sometimes"}, 400, "early_stopping"),
    ("guided two kinds", {**OK, "guided_regex": "a+", "guided_choice": ["a"]}, 400, "guided_choice"),
    ("guided_json not json", {**OK, "guided_json": "{not json"}, 400, "guided_json"),
    ("guided backend unregistered", {**OK, "guided_regex": "a+", "guided_decoding_backend": "no-such-backend"}, 400,
     "guided_decoding_backend"),
    ("structured_outputs backend unregistered", {**OK, "structured_outputs": {"regex": "a+", "backend": "nope"}}, 400,
     "guided_decoding_backend"),
    ("extra_body not object", {**OK, "extra_body": 5}, 400, "extra_body"),
    ("prompt_logprobs streamed", {**OK, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
]


@pytest.mark.parametrize("name, body, status, param", CASES, ids=[c[0] for c in CASES])
def test_bad_request(http: httpx.Client, name: str, body: object, status: int, param: str | None) -> None:
    if isinstance(body, bytes):
        response = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    else:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param, error


def test_wrong_content_type_is_415(http: httpx.Client) -> None:
    response = http.post("/v1/completions", content=b"prompt=x", headers={"Content-Type": "text/plain"})
    assert response.status_code == 415
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_oversized_body_is_413(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={**OK, "prompt": "x" * (17 * 1024 * 1024)})
    assert response.status_code == 413
    assert "error" in response.json()


def test_prompt_over_context_states_both_lengths(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={**OK, "prompt": [1] * 8200, "max_tokens": 1})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "8192" in message and "8200" in message


def test_unknown_route_is_enveloped_404(http: httpx.Client) -> None:
    response = http.get("/v1/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"
    assert response.json()["error"]["code"] == "not_found"  # a route, not a model


def test_wrong_method_is_enveloped_405_with_allow(http: httpx.Client) -> None:
    response = http.get("/v1/chat/completions")
    assert response.status_code == 405
    assert response.headers["Allow"] == "POST"
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_models_retrieve_and_an_unknown_model(http: httpx.Client) -> None:
    card = http.get(f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["object"] == "model" and card["root"] == MODEL
    response = http.get("/v1/models/gpt-17")
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model" and response.json()["error"]["code"] == "model_not_found"


def test_version(http: httpx.Client) -> None:
    assert http.get("/version").json()["version"]


def test_server_still_serves_after_bad_requests(http: httpx.Client) -> None:
    for _name, body, _status, _param in CASES:
        if isinstance(body, bytes):
            http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        else:
            http.post("/v1/completions", json=body)
    response = http.post("/v1/completions", json=OK)
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"]
