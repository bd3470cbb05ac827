"""``--adapters-dir`` over HTTP: ``peft`` picks an adapter; unknown names are 404, names that try to
leave the directory are 400, and a server without adapters refuses ``peft`` with 400."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.http.conftest import start_server, stop_server

pytest.importorskip("peft")
pytest.importorskip("transformers")

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapter_server(engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    from transformers import LlamaForCausalLM

    from tests.engine.test_lora import make_adapter

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("http-adapters")
    root, outside = tmp / "adapters", tmp / "outside"
    root.mkdir()
    base = LlamaForCausalLM.from_pretrained(str(engine_dir), dtype=torch.float32)
    make_adapter(base, root / "qv", target_modules=["q_proj", "v_proj"])
    # a perfectly good adapter, but outside: reachable only through a symlink, which is refused
    shutil.copytree(root / "qv", outside / "qv")
    os.symlink(outside / "qv", root / "escape")
    os.symlink(outside, root / "up")
    process, base_url = start_server(engine_dir, "--adapters-dir", str(root), "--dtype", "float32",
                                     "--max-batch-size", "4", "--max-model-len", "256", "--threads", "1",
                                     log_name="adapters")
    try:
        with httpx.Client(base_url=base_url, timeout=120) as client:
            yield client
    finally:
        stop_server(process)


def complete(client: httpx.Client, **body: object) -> httpx.Response:
    # seeded: a repeat takes no cached prefix, whose shorter prefill may round a near tie apart
    payload = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "seed": 0, **body}
    return client.post("/v1/completions", json=payload)


def assert_error(response: httpx.Response, status: int, kind: str) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["type"] == kind and error["param"] == "peft", error
    return error  # type: ignore[no-any-return]


def test_adapter_changes_the_completion(adapter_server: httpx.Client) -> None:
    base = complete(adapter_server)
    tuned = complete(adapter_server, peft="qv")
    assert base.status_code == 200 and tuned.status_code == 200, tuned.text
    assert tuned.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]
    # streamed, several prompts (each its own engine request), and mixed with plain requests
    again = complete(adapter_server, peft="qv", prompt=[PROMPT, PROMPT])
    assert [c["text"] for c in again.json()["choices"]] == [tuned.json()["choices"][0]["text"]] * 2
    with adapter_server.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 6,
                                                                "temperature": 0, "seed": 0, "peft": "qv",
                                                                "stream": True}) as stream:
        assert stream.status_code == 200
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in stream.iter_lines()
                       if line.startswith("data: {") and json.loads(line[6:])["choices"])
    assert text == tuned.json()["choices"][0]["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_adapter_is_404(adapter_server: httpx.Client, stream: bool) -> None:
    error = assert_error(complete(adapter_server, peft="nope", stream=stream), 404, "not_found_error")
    assert error["code"] == "adapter_not_found" and "nope" in str(error["message"])


def test_unknown_adapter_in_a_multi_prompt_request_is_404(adapter_server: httpx.Client) -> None:
    assert_error(complete(adapter_server, peft="nope", prompt=[PROMPT, "Hello"]), 404, "not_found_error")


@pytest.mark.parametrize("name", ["../x", "/etc", "a/b", "..", ".", "escape", "up", "qv/..", "..\\qv", "",
                                  "/tmp/adapters/qv"])
@pytest.mark.parametrize("stream", [False, True])
def test_names_that_leave_the_directory_are_400(adapter_server: httpx.Client, name: str, stream: bool) -> None:
    assert_error(complete(adapter_server, peft=name, stream=stream), 400, "invalid_request_error")


def test_still_serving_after_refusals(adapter_server: httpx.Client) -> None:
    assert complete(adapter_server, peft="qv").status_code == 200
    assert adapter_server.get("/health").status_code == 200


def test_peft_without_adapters_dir_is_400(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "peft": "qv"})
    error = assert_error(response, 400, "invalid_request_error")
    assert "--adapters-dir" in str(error["message"])
