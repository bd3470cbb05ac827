from __future__ import annotations

import json
import subprocess
import sys

import pytest
import trtserver_fingerprint
from trtserver_fingerprint import compute_fingerprint, fingerprint_facts, trtserver_system_fingerprint

from trtserver.engine.base import EngineInfo
from trtserver.http.app import STATE

MANIFEST = {"served_model_name": "m", "weights_sha256": "ab" * 32, "dtype": "bfloat16", "format": "safetensors",
            "format_version": 1}


def make_info(backend: str = "torch", **changes: object) -> EngineInfo:
    return EngineInfo(model_name="m", context_length=8, vocab_size=8, eos_token_ids=(0,),
                      fingerprint_inputs={**MANIFEST, **changes}, backend=backend)


def test_shape() -> None:
    fp = trtserver_system_fingerprint(make_info())
    assert fp.startswith("fp_") and len(fp) == 15
    int(fp[3:], 16)


def test_stable_across_restarts() -> None:
    """A fresh interpreter (new hash seed, new import) computes the same value for the same build."""
    here = trtserver_system_fingerprint(make_info())
    code = ("import json, sys; from trtserver.engine.base import EngineInfo; "
            "from trtserver_fingerprint import trtserver_system_fingerprint as f; "
            "print(f(EngineInfo('m', 8, 8, (0,), fingerprint_inputs=json.loads(sys.argv[1]), backend='torch')))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(dict(reversed(MANIFEST.items())))],
                         capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "123"})
    assert out.stdout.strip() == here


@pytest.mark.parametrize("change", [{"served_model_name": "other"}, {"weights_sha256": "cd" * 32},
                                   {"dtype": "float16"}, {"format": "gguf"}, {"format_version": 2}])
def test_changes_with_each_manifest_fact(change: dict[str, object]) -> None:
    assert trtserver_system_fingerprint(make_info(**change)) != trtserver_system_fingerprint(make_info())


def test_changes_with_backend_and_runtime_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    base = trtserver_system_fingerprint(make_info())
    assert trtserver_system_fingerprint(make_info(backend="trtllm")) != base
    facts = fingerprint_facts(make_info())
    assert facts["torch"] and facts["trtserver"]
    for runtime in ("torch", "trtserver"):
        versions = {"torch": facts["torch"], "trtserver": facts["trtserver"], runtime: "0.0.0-other"}
        monkeypatch.setattr(trtserver_fingerprint, "_version", versions.get)
        assert trtserver_system_fingerprint(make_info()) != base
    assert compute_fingerprint(facts) == base


def test_tensorrt_llm_is_never_imported() -> None:
    trtserver_system_fingerprint(make_info(backend="trtllm"))
    assert "tensorrt_llm" not in sys.modules


# trtserver's pytest config runs async fixtures on one loop for the whole run; the test must share it
@pytest.mark.asyncio(loop_scope="session")
async def test_in_every_response_and_chunk(trtserver_client_factory) -> None:  # type: ignore[no-untyped-def]
    client = await trtserver_client_factory(plugins=[trtserver_fingerprint], plugin_allowlist=[],
                                           max_batch_size=4, max_model_len=512)
    expected = trtserver_system_fingerprint(client.app[STATE].engine.info)
    body = {"prompt": ["Hello", "Hi"], "max_tokens": 4, "n": 2}
    response = await client.post("/v1/completions", json=body)
    assert response.status == 200
    assert (await response.json())["system_fingerprint"] == expected
    response = await client.post("/v1/completions", json={**body, "stream": True,
                                                          "stream_options": {"include_usage": True}})
    events = [line[6:] for line in (await response.text()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert len(chunks) > 2
    assert {chunk["system_fingerprint"] for chunk in chunks} == {expected}
