"""Import hygiene, version detection and trtllm_unavailable_reason (no tensorrt_llm installed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.standins import harness
from trtserver.config import ServerConfig
from trtserver.engine.trtllm.version import (
    Generation,
    TrtllmVersionError,
    choose_generation,
    detect,
    parse_release,
)

standin = harness.standin


def test_importing_trtserver_never_imports_tensorrt_llm() -> None:
    code = (
        "import sys, trtserver, trtserver.engine.trtllm, trtserver.engine.trtllm.mapping, "
        "trtserver.engine.trtllm.request, trtserver.engine.trtllm.stream, trtserver.engine.trtllm.logits; "
        "bad = [m for m in ('tensorrt_llm', 'torch') if m in sys.modules]; print(bad); sys.exit(bool(bad))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_in_process_too() -> None:
    import trtserver  # noqa: F401
    import trtserver.engine.trtllm  # noqa: F401

    assert "tensorrt_llm" not in sys.modules


@pytest.mark.parametrize(
    ("version", "release"), [("1.2.0rc2", (1, 2, 0)), ("0.12.0-jetson", (0, 12, 0)), ("0.21", (0, 21, 0))]
)
def test_parse_release(version: str, release: tuple[int, int, int]) -> None:
    assert parse_release(version) == release


def test_choose_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("trtserver.engine.trtllm.version.on_tegra", lambda: False)
    assert choose_generation("1.0.0", has_engine=True) is Generation.V1_ENGINE
    assert choose_generation("1.2.1", has_engine=False) is Generation.V1_PYTORCH
    assert choose_generation("0.18.2", has_engine=True) is Generation.V0
    assert choose_generation("0.12.0", has_engine=True) is Generation.V0
    assert choose_generation("0.12.0-jetson", has_engine=True) is Generation.JETSON
    monkeypatch.setattr("trtserver.engine.trtllm.version.on_tegra", lambda: True)
    assert choose_generation("0.12.0", has_engine=True) is Generation.JETSON
    with pytest.raises(TrtllmVersionError, match="older than 0.12"):
        choose_generation("0.11.0", has_engine=True)
    with pytest.raises(TrtllmVersionError, match="PyTorch backend starts at 1.0"):
        choose_generation("0.20.0", has_engine=False)


def test_detect_probes_each_standin(standin: Any) -> None:
    f = detect(standin("v1"), has_engine=True)
    assert f.generation is Generation.V1_ENGINE and f.has_abort and f.dynamic_logits_processor
    assert f.lora and not f.priority and f.multiple_sequences and f.has_guided_params
    assert f.name("max_tokens", "max_new_tokens") == "max_tokens"
    f = detect(standin("v0"), has_engine=True)
    assert f.generation is Generation.V0 and not f.has_abort and not f.dynamic_logits_processor
    assert f.has_guided_params and f.lora and "prompt_logprobs" not in f.sampling_fields
    f = detect(standin("jetson"), has_engine=True)
    assert not f.has_abort and not f.multiple_sequences and not f.lora and not f.has_guided_params
    assert f.name("stop_token_ids") == "stop_token_ids" and f.name("seed", "random_seed") == "random_seed"
    assert f.name("max_tokens", "max_new_tokens") == "max_new_tokens" and "embedding_bias" in f.sampling_fields


def test_stub_without_version_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    with pytest.raises(TrtllmVersionError, match="stub"):
        detect(types.ModuleType("tensorrt_llm"), has_engine=True)


def test_unavailable_without_tensorrt_llm(tmp_path: Path) -> None:
    from trtserver.engine.trtllm import trtllm_unavailable_reason

    harness.clear_trtllm_modules()
    root = harness.make_engine_dir(tmp_path / "e")
    assert trtllm_unavailable_reason(ServerConfig(engine_dir=str(root))) == "TensorRT-LLM is not installed"


def test_unavailable_reasons_with_standin(
    standin: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from trtserver.engine import trtllm

    standin("v1")
    config = ServerConfig(engine_dir=str(harness.make_engine_dir(tmp_path / "e")))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert trtllm.trtllm_unavailable_reason(config) == "no CUDA device is visible"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(trtllm.availability, "installed_trtllm_version", lambda: "1.2.0")
    assert trtllm.trtllm_unavailable_reason(config) is None
    monkeypatch.setattr(trtllm.availability, "installed_trtllm_version", lambda: "1.2.1")
    assert "rebuild" in (trtllm.trtllm_unavailable_reason(config) or "")
    plain = ServerConfig(engine_dir=str(harness.make_engine_dir(tmp_path / "p", trtllm_version=None)))
    assert "no TensorRT-LLM engine" in (trtllm.trtllm_unavailable_reason(plain) or "")
    assert trtllm.trtllm_unavailable_reason(plain, allow_hf_checkpoint=True) is None
    assert "no manifest" in (trtllm.trtllm_unavailable_reason(ServerConfig(engine_dir=str(tmp_path))) or "")
