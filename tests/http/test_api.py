"""The whole completions API on the real model, as OpenAI / vLLM clients use it."""

from __future__ import annotations

import math

import httpx
import pytest
from openai import OpenAI

from tests.http.conftest import LOGPROB_TOLERANCE, MODEL

PROMPT = "The capital of France is"


def post(http: httpx.Client, **body: object) -> dict:
    response = http.post("/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def stream(http: httpx.Client, **body: object) -> list[dict]:
    import json

    chunks = []
    with http.stream("POST", "/v1/completions", json={"model": MODEL, "stream": True, **body}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


# --- prompts, n, indexes, usage ---------------------------------------------------------------

def test_prompt_forms_and_choice_indexes(http: httpx.Client) -> None:
    ids = post(http, prompt=PROMPT, max_tokens=1, temperature=0, return_token_ids=True)["choices"][0][
        "prompt_token_ids"]
    # seeded: neither answer takes a cached prefix, whose shorter prefill may round a near tie apart
    text_answer = post(http, prompt=PROMPT, max_tokens=4, temperature=0, seed=0)["choices"][0]["text"]
    assert post(http, prompt=ids, max_tokens=4, temperature=0, seed=0)["choices"][0]["text"] == text_answer
    batch = post(http, prompt=[ids, ids[:3]], max_tokens=3, temperature=0, n=2)
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert batch["choices"][0]["text"] == batch["choices"][1]["text"]  # greedy n=2: identical
    assert batch["usage"]["prompt_tokens"] == len(ids) + 3  # each prompt counted once, not per choice
    assert batch["usage"]["completion_tokens"] == 12
    strings = post(http, prompt=["Hello", "Goodbye"], max_tokens=2, temperature=0)
    assert len(strings["choices"]) == 2


def test_max_tokens_defaults_to_16(http: httpx.Client) -> None:
    body = post(http, prompt="Once upon a time", temperature=0, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 16


def test_model_may_be_omitted(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert response.status_code == 200
    assert response.json()["model"] == MODEL


# --- sampling, seeds, best_of, beams ------------------------------------------------------------

def test_seed_with_n_gives_distinct_repeatable_choices(http: httpx.Client) -> None:
    a = post(http, prompt="Once upon a time", max_tokens=10, n=3, seed=11, temperature=1.0)
    b = post(http, prompt="Once upon a time", max_tokens=10, n=3, seed=11, temperature=1.0)
    texts = [c["text"] for c in a["choices"]]
    assert texts == [c["text"] for c in b["choices"]]
    assert len(set(texts)) > 1


def test_best_of_returns_n_ranked_by_mean_logprob(http: httpx.Client) -> None:
    body = post(http, prompt="Once upon a time", max_tokens=8, n=2, best_of=5, seed=3, logprobs=0)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    means = [sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["token_logprobs"]) for c in body["choices"]]
    assert means[0] >= means[1]
    assert body["usage"]["completion_tokens"] == 5 * 8  # every sampled sequence is paid for


def test_beam_search(http: httpx.Client) -> None:
    body = post(http, prompt=PROMPT, max_tokens=6, n=2, use_beam_search=True, temperature=0,
                length_penalty=1.0, early_stopping=True)
    assert len(body["choices"]) == 2
    assert body["choices"][0]["text"] != body["choices"][1]["text"]
    greedy = post(http, prompt=PROMPT, max_tokens=6, temperature=0)["choices"][0]["text"]
    assert greedy.startswith(" Paris") and "Paris" in body["choices"][0]["text"] + body["choices"][1]["text"]


def test_penalties_and_logit_bias(http: httpx.Client) -> None:
    base = post(http, prompt="1, 1, 1, 1, 1,", max_tokens=8, temperature=0)["choices"][0]["text"]
    penalised = post(http, prompt="1, 1, 1, 1, 1,", max_tokens=8, temperature=0,
                     frequency_penalty=2.0, presence_penalty=2.0)["choices"][0]["text"]
    assert base != penalised
    ids = post(http, prompt="x", max_tokens=1, temperature=0, return_token_ids=True)
    forced_id = 4649  # " France"
    forced = post(http, prompt="Hello", max_tokens=3, temperature=0, logit_bias={str(forced_id): 100},
                  return_token_ids=True)
    assert forced["choices"][0]["token_ids"] == [forced_id] * 3
    first = post(http, prompt=PROMPT, max_tokens=1, temperature=0, return_token_ids=True)["choices"][0]["token_ids"]
    banned = post(http, prompt=PROMPT, max_tokens=1, temperature=0, logit_bias={str(first[0]): -100},
                  return_token_ids=True)
    assert banned["choices"][0]["token_ids"] != first
    assert ids["choices"][0]["token_ids"]


def test_min_tokens_and_ignore_eos(http: httpx.Client) -> None:
    prompt = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"  # "The answer is 4." and EOS
    short = post(http, prompt=prompt, max_tokens=64, temperature=0)
    assert short["choices"][0]["finish_reason"] == "stop"
    n = short["usage"]["completion_tokens"]
    longer = post(http, prompt=prompt, max_tokens=64, temperature=0, min_tokens=n + 5)
    assert longer["usage"]["completion_tokens"] >= n + 5
    ignored = post(http, prompt=prompt, max_tokens=n + 8, temperature=0, ignore_eos=True)
    assert ignored["usage"]["completion_tokens"] == n + 8
    assert ignored["choices"][0]["finish_reason"] == "length"


# --- stops ----------------------------------------------------------------------------------------

def test_stop_strings(http: httpx.Client) -> None:
    # seeded: no request takes a cached prefix, whose shorter prefill may round a near tie apart
    full = post(http, prompt="1, 2, 3,", max_tokens=12, temperature=0, seed=0)["choices"][0]["text"]
    assert " 5" in full
    body = post(http, prompt="1, 2, 3,", max_tokens=12, temperature=0, seed=0, stop=[" 7", " 5"])
    choice = body["choices"][0]
    assert choice["text"] == full[: full.index(" 5")]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == " 5"
    kept = post(http, prompt="1, 2, 3,", max_tokens=12, temperature=0, seed=0, stop=" 5",
                include_stop_str_in_output=True)
    assert kept["choices"][0]["text"] == full[: full.index(" 5") + 2]


def test_streamed_stop_never_leaks_partial(http: httpx.Client) -> None:
    chunks = stream(http, prompt="1, 2, 3,", max_tokens=12, temperature=0, stop=[" 5,"])
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert " 5" not in text and text.endswith("4,")
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_stop_token_ids(http: httpx.Client) -> None:
    # seeded: neither takes a cached prefix, whose shorter prefill may round a near tie apart
    first = post(http, prompt="1, 2, 3,", max_tokens=4, temperature=0, seed=0, return_token_ids=True)["choices"][0]
    stop_id = first["token_ids"][1]
    body = post(http, prompt="1, 2, 3,", max_tokens=4, temperature=0, seed=0, stop_token_ids=[stop_id],
                return_token_ids=True)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id
    assert choice["token_ids"] == first["token_ids"][:2]


# --- echo, logprobs, loglikelihood -----------------------------------------------------------------

def test_logprobs_object(http: httpx.Client) -> None:
    body = post(http, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 5
    assert "".join(lp["tokens"]) == body["choices"][0]["text"]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert token in top and top[token] == logprob
        assert len(top) <= 4 and logprob <= 0
        assert max(top.values()) == logprob  # greedy: the sampled token is the most likely
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]


def test_echo_scoring_call_of_lm_eval(http: httpx.Client) -> None:
    body = post(http, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == 5 and all(v < 0 for v in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"]) == PROMPT
    assert body["usage"]["completion_tokens"] == 0
    # the prompt token logprobs agree with what generation reports for the same continuation
    # seeded: like the scoring call, it computes its whole prompt rather than start after a cached prefix
    cont = post(http, prompt="The capital of France", max_tokens=1, temperature=0, seed=0, logprobs=5)
    assert math.isclose(cont["choices"][0]["logprobs"]["top_logprobs"][0][" is"], lp["token_logprobs"][4],
                        abs_tol=LOGPROB_TOLERANCE)


def test_echo_with_completion_and_offsets(http: httpx.Client) -> None:
    body = post(http, prompt=PROMPT, max_tokens=3, echo=True, logprobs=0, temperature=0)
    choice = body["choices"][0]
    assert choice["text"].startswith(PROMPT) and len(choice["logprobs"]["tokens"]) == 8
    assert choice["logprobs"]["text_offset"][5] == len(PROMPT)


def test_loglikelihood_octoai(http: httpx.Client) -> None:
    body = post(http, prompt=PROMPT, max_tokens=1, loglikelihood=True, temperature=0)
    ll = body["choices"][0]["loglikelihood"]
    assert len(ll["token_logprobs"]) == 4 and all(v is not None and v < 0 for v in ll["token_logprobs"])
    assert not body["choices"][0]["text"].startswith(PROMPT)


def test_vllm_prompt_logprobs(http: httpx.Client) -> None:
    body = post(http, prompt=PROMPT, max_tokens=1, prompt_logprobs=2, temperature=0)
    prompt_lps = body["choices"][0]["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == 5
    assert all(len(entry) >= 2 for entry in prompt_lps[1:])


def test_streamed_logprobs_and_echo(http: httpx.Client) -> None:
    chunks = stream(http, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True)
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == 9


# --- special tokens, suffix ----------------------------------------------------------------------

def test_special_tokens_handling(http: httpx.Client) -> None:
    # force "Hi" then <|im_end|> (id 2) twice: EOS is ignored so the special token stays in the output
    hi = post(http, prompt="x", max_tokens=1, temperature=0, return_token_ids=True)
    forced = {"logit_bias": {"2": 100}, "ignore_eos": True, "max_tokens": 2, "temperature": 0}
    kept = post(http, prompt="Say", skip_special_tokens=False, **forced)["choices"][0]["text"]
    assert kept == "<|im_end|> <|im_end|>"
    tight = post(http, prompt="Say", skip_special_tokens=False, spaces_between_special_tokens=False,
                 **forced)["choices"][0]["text"]
    assert tight == "<|im_end|><|im_end|>"
    assert post(http, prompt="Say", **forced)["choices"][0]["text"] == ""
    with_bos = post(http, prompt="Hi", max_tokens=1, add_special_tokens=True, return_token_ids=True)
    assert with_bos["choices"][0]["prompt_token_ids"][0] != 1  # SmolLM2 adds no BOS (add_bos_token false)
    assert hi["choices"][0]["token_ids"]


def test_suffix_is_refused_without_fim_tokens(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "def f(", "suffix": "return x"})
    assert response.status_code == 400
    assert "fill-in-the-middle" in response.json()["error"]["message"]


# --- streaming options, unknown fields, extra_body ------------------------------------------------

def test_stream_include_usage_and_continuous_stats(http: httpx.Client) -> None:
    chunks = stream(http, prompt=PROMPT, max_tokens=4, temperature=0, stream_options={"include_usage": True})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["usage"] is None for c in chunks[:-1])
    continuous = stream(http, prompt=PROMPT, max_tokens=4, temperature=0,
                        stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [c["usage"]["completion_tokens"] for c in continuous[:-1]]
    assert counts == sorted(counts) and counts[-1] == 4


def test_unknown_fields_are_accepted_and_extra_body_merged(http: httpx.Client) -> None:
    body = post(http, prompt=PROMPT, max_tokens=3, temperature=0, some_future_field={"x": 1},
                extra_body={"ignore_eos": True, "max_tokens": 5})
    assert body["usage"]["completion_tokens"] == 3  # explicit top-level max_tokens wins over extra_body


def test_openai_sdk_extra_body(client: OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                           extra_body={"top_k": 1, "repetition_penalty": 1.0})
    assert completion.choices[0].text.startswith(" Paris")


@pytest.mark.parametrize("flag", [{"n": 2}, {"logprobs": 1}])
def test_streamed_equals_collected(http: httpx.Client, flag: dict) -> None:
    full = post(http, prompt="Once upon a time", max_tokens=10, seed=5, **flag)
    chunks = stream(http, prompt="Once upon a time", max_tokens=10, seed=5, **flag)
    for choice in full["choices"]:
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] ==
                       choice["index"])
        assert text == choice["text"]


def test_bad_words(http: httpx.Client) -> None:
    base = post(http, prompt=PROMPT, max_tokens=4, temperature=0)["choices"][0]["text"]
    assert "Paris" in base
    banned = post(http, prompt=PROMPT, max_tokens=4, temperature=0, bad_words=["Paris"])["choices"][0]["text"]
    assert "Paris" not in banned
