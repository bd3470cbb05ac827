"""Property-based fuzzing of the HTTP API from its own ``/openapi.json`` (schemathesis).

A real server with small limits (so every generated request is cheap) gets schema-valid and
schema-violating requests for every operation. Properties:

* never a 5xx;
* every 4xx is the OpenAI envelope ``{"error": {"message", "type", "param", "code"}}``;
* every 200 JSON body conforms to the documented response schema;
* every 200 SSE body (``stream: true``) ends with ``data: [DONE]``.

Reproducible: the examples are derandomized (fixed by the test's name), so CI sees the same ones.
"""

from __future__ import annotations

import collections
import copy
import gzip
import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests  # schemathesis's transport
import schemathesis  # a hard import: a missing dev dependency is an error, never a silent skip
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import response_schema_conformance

from tests.http.conftest import start_server
from trtserver.http.openapi import openapi_document

LIMITS = ("--max-model-len", "64", "--max-n", "2", "--max-best-of", "2", "--max-prompts", "2",
          "--max-batch-size", "4", "--guided-compile-timeout-s", "5")
# generated examples per operation (the full document's coverage phase adds ~900 cheap boundary cases)
MAX_EXAMPLES = int(os.environ.get("TRTSERVER_FUZZ_EXAMPLES", "60"))
NARROW_EXAMPLES = int(os.environ.get("TRTSERVER_FUZZ_NARROW_EXAMPLES", "50"))
ENVELOPE_KEYS = {"message", "type", "param", "code"}
SEEN: collections.Counter[str] = collections.Counter()  # outcome -> count, for the coverage check at the end

# the document the server publishes is the one built from the structs (the fixture checks); fuzz from it
schema = schemathesis.openapi.from_dict(openapi_document())


def _within_limits() -> dict[str, object]:
    """The same document with /v1/completions narrowed to requests inside this server's limits.

    The full document mostly yields requests refused by validation (every optional field is
    present with some probability); this one, schema-valid only, reaches the engine, so the
    200 properties (JSON schema, SSE ``[DONE]``) are exercised on many examples."""
    document = copy.deepcopy(openapi_document())
    document["paths"] = {"/v1/completions": document["paths"]["/v1/completions"]}
    token = {"type": "integer", "minimum": 0, "maximum": 49151}  # the model's vocabulary
    short = {"type": "string", "maxLength": 24}
    nullable = lambda sub: {"anyOf": [sub, {"type": "null"}]}  # noqa: E731
    request = document["components"]["schemas"]["CompletionRequest"]
    request["properties"] = {
        # one kind per list, as the server wants (the full schema also allows mixed lists: see the first test)
        "prompt": {"anyOf": [short, *({"type": "array", "minItems": 1, "maxItems": 2, "items": item} for item in (
            short, token, {"type": "array", "minItems": 1, "maxItems": 12, "items": token}))]},
        "max_tokens": nullable({"type": "integer", "minimum": 0, "maximum": 6}),
        "min_tokens": {"type": "integer", "minimum": 0, "maximum": 3},
        "n": {"type": "integer", "minimum": 1, "maximum": 2},
        "best_of": nullable({"type": "integer", "minimum": 1, "maximum": 2}),
        "logprobs": nullable({"type": "integer", "minimum": 0, "maximum": 5}),
        "prompt_logprobs": nullable({"type": "integer", "minimum": 0, "maximum": 5}),
        "stop": {"anyOf": [short, {"type": "array", "maxItems": 4, "items": short}, {"type": "null"}]},
        "stop_token_ids": nullable({"type": "array", "maxItems": 3, "items": token}),
        "bad_words": nullable({"type": "array", "maxItems": 3, "items": short}),
        "allowed_token_ids": nullable({"type": "array", "minItems": 1, "maxItems": 5, "items": token}),
        "logit_bias": nullable({"type": "object", "maxProperties": 3, "propertyNames": {"pattern": "^[0-9]{1,4}$"},
                                "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}),
        "seed": nullable({"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}),
        "service_tier": nullable({"enum": ["auto", "default", "flex"]}),
        "stream_options": nullable({"$ref": "#/components/schemas/StreamOptions"}),
        **{name: request["properties"][name] for name in (
            "echo", "frequency_penalty", "presence_penalty", "repetition_penalty", "stream", "suffix", "temperature",
            "top_p", "top_k", "min_p", "user", "use_beam_search", "length_penalty", "ignore_eos",
            "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
            "truncate_prompt_tokens", "add_special_tokens", "return_tokens_as_token_ids", "return_token_ids",
            "loglikelihood")},
    }
    request["required"] = ["prompt", "stream"]  # about half of them streamed
    request["properties"]["truncate_prompt_tokens"] = nullable({"type": "integer", "minimum": 1, "maximum": 64})
    request["properties"]["repetition_penalty"] = nullable({"type": "number", "minimum": 0.5, "maximum": 2})
    return document


narrow = schemathesis.openapi.from_dict(_within_limits())
narrow.config.generation.update(modes=["positive"])
narrow.config.phases.update(phases=["examples", "fuzzing"])
for _loaded in (schema, narrow):
    # schemathesis stops reading an SSE body after 20 events by default: read all of it ([DONE] is last)
    _loaded.config.max_stream_events = 100_000


@pytest.fixture(scope="module")
def fuzz_base_url(engine_dir: Path) -> Iterator[str]:
    process, base = start_server(engine_dir, *LIMITS, log_name="fuzz")
    try:
        served = requests.get(f"{base}/openapi.json", timeout=10).json()
        assert served == json.loads(json.dumps(openapi_document())), "served /openapi.json differs from the structs'"
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except Exception:
            process.kill()


def header(response: schemathesis.Response, name: str) -> str:
    """schemathesis keeps headers lower-cased, as lists."""
    values = response.headers.get(name.lower()) or [""]
    return str(values[0])


def check_envelope(response: schemathesis.Response) -> None:
    assert header(response, "Content-Type").startswith("application/json"), response.headers
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == ENVELOPE_KEYS, body
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and error["type"], body
    assert error["param"] is None or isinstance(error["param"], str), body
    assert error["code"] is None or isinstance(error["code"], str), body


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_api_properties(case: schemathesis.Case, fuzz_base_url: str) -> None:
    check_properties(case, fuzz_base_url)


@narrow.parametrize()
@settings(max_examples=NARROW_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_completions_within_limits(case: schemathesis.Case, fuzz_base_url: str) -> None:
    check_properties(case, fuzz_base_url)


def check_properties(case: schemathesis.Case, fuzz_base_url: str) -> None:
    response = case.call(base_url=fuzz_base_url, timeout=60)
    status = response.status_code
    kind = header(response, "Content-Type").split(";")[0]
    SEEN[f"{case.method} {case.path} {status} {kind}"] += 1
    assert status < 500, f"{status} for {case.body!r}: {response.text[:500]}"
    if 400 <= status < 500:
        check_envelope(response)
        return
    content_type = header(response, "Content-Type")
    if status == 200 and content_type.startswith("text/event-stream"):
        text = response.text
        assert text.endswith("data: [DONE]\n\n"), text[-300:]
        for event in text.split("\n\n")[:-2]:
            assert event.startswith("data: "), event
            chunk = json.loads(event[len("data: "):])
            assert "error" not in chunk, chunk  # an error after the headers went out is still a failure
        return
    if status == 200 and content_type.startswith("application/json"):
        case.validate_response(response, checks=[response_schema_conformance])


# --- what the schema cannot generate: nesting, encodings, header bytes ---------------------------

HOSTILE_EXAMPLES = int(os.environ.get("TRTSERVER_FUZZ_HOSTILE_EXAMPLES", "25"))
FIELDS = ("prompt", "guided_json", "extra_body", "logits_processors", "logit_bias", "stop", "no_such_field")


def check_raw(response: requests.Response) -> None:
    assert response.status_code < 500, f"{response.status_code}: {response.text[:300]}"
    assert response.headers.get("X-Request-Id"), response.headers
    if response.status_code >= 400:
        assert response.headers.get("Content-Type", "").startswith("application/json"), response.headers
        error = response.json()["error"]
        assert set(error) == ENVELOPE_KEYS and error["message"], error


SHAPES = {"array": ("[", "", "]"), "object": ('{"k":', "1", "}"), "mixed": ('[{"k":', "1", "}]")}


@given(depth=st.integers(min_value=1, max_value=30_000), field=st.sampled_from(FIELDS),
       shape=st.sampled_from(sorted(SHAPES)), closed=st.booleans())
@settings(max_examples=HOSTILE_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_deep_nesting_is_never_a_5xx(fuzz_base_url: str, depth: int, field: str, shape: str, closed: bool) -> None:
    opener, inner, closer = SHAPES[shape]
    value = opener * depth + inner + (closer * depth if closed else "")
    body = f'{{"prompt": "Hi", "max_tokens": 1, "{field}": {value}}}'.encode()
    check_raw(requests.post(f"{fuzz_base_url}/v1/completions", data=body, timeout=60,
                            headers={"Content-Type": "application/json"}))


@given(encoding=st.sampled_from(["gzip", "deflate", "br", "zstd", "x-gzip", "identity", "gzip, deflate", "GZIP",
                                 "compress", ""]),
       payload=st.sampled_from(["plain", "gzip", "deflate", "truncated", "noise"]), noise=st.binary(max_size=64))
@settings(max_examples=HOSTILE_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_content_encodings_are_never_a_5xx(fuzz_base_url: str, encoding: str, payload: str, noise: bytes) -> None:
    plain = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
    data = {"plain": plain, "gzip": gzip.compress(plain), "deflate": zlib.compress(plain),
            "truncated": gzip.compress(plain)[:12], "noise": noise}[payload]
    check_raw(requests.post(f"{fuzz_base_url}/v1/completions", data=data, timeout=60,
                            headers={"Content-Type": "application/json", "Content-Encoding": encoding}))


@given(request_id=st.binary(min_size=1, max_size=300).filter(lambda b: b"\r" not in b and b"\n" not in b
                                                               and b"\x00" not in b and b.strip() == b),
       stream=st.booleans())
@settings(max_examples=HOSTILE_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_request_id_bytes_are_never_a_5xx(fuzz_base_url: str, request_id: bytes, stream: bool) -> None:
    response = requests.post(f"{fuzz_base_url}/v1/completions", timeout=60, headers={"X-Request-Id": request_id},
                             json={"prompt": "Hi", "max_tokens": 1, "stream": stream})
    check_raw(response)
    if response.status_code == 200:
        assert response.headers["X-Request-Id"].encode("latin-1") == request_id


def test_fuzzing_reached_every_outcome() -> None:
    """The properties above are only worth something if the fuzzer got past validation."""
    print(dict(SEEN))
    completions = {key: n for key, n in SEEN.items() if key.startswith("POST /v1/completions")}
    assert completions, "run the whole module: the fuzz test did not run first"
    assert completions.get("POST /v1/completions 200 application/json", 0) >= NARROW_EXAMPLES // 5, SEEN
    assert completions.get("POST /v1/completions 200 text/event-stream", 0) >= NARROW_EXAMPLES // 20, SEEN
    assert completions.get("POST /v1/completions 400 application/json", 0) >= MAX_EXAMPLES, SEEN
