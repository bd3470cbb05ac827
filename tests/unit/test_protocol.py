from __future__ import annotations

import msgspec
import pytest

from trtserver.protocol import REQUEST_FIELDS, CompletionRequest, FieldError, request_decoder


def decode(body: dict) -> CompletionRequest:
    request = request_decoder.decode(msgspec.json.encode(body))
    request.check()
    return request


@pytest.mark.parametrize("prompt, expected", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_forms(prompt: object, expected: list) -> None:
    assert decode({"prompt": prompt}).prompts == expected


def test_defaults_are_openai_and_vllm() -> None:
    request = decode({"prompt": "x"})
    assert request.n == 1 and request.max_tokens is None and request.echo is False
    assert request.skip_special_tokens and request.add_special_tokens
    assert request.temperature is None and request.top_p is None


@pytest.mark.parametrize("body, param", [
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"),
    ({"prompt": "x", "stop": ["a", ""]}, "stop"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    ({"prompt": "x", "n": 1, "best_of": 2, "stream": True}, "best_of"),
    ({"prompt": "x", "use_beam_search": True, "stream": True}, "use_beam_search"),
    ({"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "x", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_cross_field_rules_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(FieldError) as info:
        decode(body)
    assert info.value.param == param


@pytest.mark.parametrize("body, path", [
    ({"prompt": "x", "temperature": 2.5}, "$.temperature"),
    ({"prompt": "x", "top_p": 0}, "$.top_p"),
    ({"prompt": "x", "n": 0}, "$.n"),
    ({"prompt": "x", "logprobs": -1}, "$.logprobs"),
    ({"prompt": "x", "frequency_penalty": 3}, "$.frequency_penalty"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "$.logit_bias"),
    ({"prompt": "x", "service_tier": "gold"}, "$.service_tier"),
    ({"prompt": "x", "repetition_penalty": 0}, "$.repetition_penalty"),
    ({"prompt": [-1]}, "$.prompt"),
    ({"prompt": "x", "seed": 2**64}, "$.seed"),
])
def test_field_ranges(body: dict, path: str) -> None:
    with pytest.raises(msgspec.ValidationError) as info:
        decode(body)
    assert path in str(info.value)


def test_every_extension_field_parses() -> None:
    for name in ["guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                 "structured_outputs", "response_format", "ignore_eos", "loglikelihood", "peft", "log_prompt",
                 "service_tier", "extra_body", "stream_options", "use_beam_search", "min_p", "top_k",
                 "stop_token_ids", "include_stop_str_in_output", "min_tokens", "prompt_logprobs"]:
        assert name in REQUEST_FIELDS
    request = decode({"prompt": "x", "guided_json": {"type": "object"}, "structured_outputs": {"regex": "a+"},
                      "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {}}},
                      "service_tier": "flex", "peft": "my-adapter", "early_stopping": "never"})
    assert request.response_format is not None and request.response_format.json_schema is not None
    assert request.response_format.json_schema.schema_ == {}
    assert request.early_stopping == "never"


def test_unknown_fields_do_not_fail() -> None:
    assert decode({"prompt": "x", "something_new": 1}).prompts == ["x"]
