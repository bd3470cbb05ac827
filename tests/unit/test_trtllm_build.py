"""build_engines.trtllm_build without TensorRT-LLM: the one-line skip, and the commands it would run."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from build_engines import trtllm_build as tb
from trtserver.manifest import Manifest, Source


def manifest(context: int = 2048) -> Manifest:
    return Manifest(
        served_model_name="m",
        source=Source(kind="hf-checkpoint", location="x", sha256="0"),
        dtype="float32",
        context_length=context,
        weights_sha256="1",
        created_by="test",
    )


def test_without_tensorrt_llm_prints_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tb, "_have_trtllm", lambda: False)
    assert tb.maybe_build_trtllm(tmp_path, manifest(), tb.TrtllmBuildOptions()) is None
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "portable" in out
    assert tb.maybe_build_trtllm(tmp_path, manifest(), tb.TrtllmBuildOptions(enabled=False)) is None


def test_resolve_args_clamps_to_the_model() -> None:
    args = tb.resolve_args(manifest(2048), tb.TrtllmBuildOptions(gather_context_logits=True))
    assert args == {
        "dtype": "float16",
        "max_batch_size": 64,
        "max_input_len": 2048,
        "max_seq_len": 2048,
        "gather_context_logits": True,
    }


def fake_tools(monkeypatch: pytest.MonkeyPatch, calls: list[list[str]]) -> None:
    monkeypatch.setattr(tb, "_have_trtllm", lambda: True)
    monkeypatch.setattr(tb, "_cuda_available", lambda: True)
    monkeypatch.setattr(tb, "_trtllm_version", lambda: "1.2.0")

    def run(cmd: list[str], timeout: float) -> str:
        calls.append(cmd)
        out = Path(cmd[cmd.index("--output_dir") + 1]) if "--output_dir" in cmd else None
        if cmd[0] == "trtllm-build" and out is not None:
            out.mkdir(parents=True)
            (out / "config.json").write_text("{}")
        if cmd[1] == "-c":
            out = Path(json.loads(cmd[3])["out"])
            out.mkdir(parents=True)
            (out / "config.json").write_text("{}")
        return ""

    monkeypatch.setattr(tb, "_run", run)


def test_two_step_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    examples = tmp_path / "examples" / "models" / "core" / "llama"
    examples.mkdir(parents=True)
    (examples / "convert_checkpoint.py").write_text("")
    monkeypatch.setenv("TRTLLM_EXAMPLES_DIR", str(tmp_path / "examples"))
    monkeypatch.setattr(tb.shutil, "which", lambda name: "/usr/bin/" + name)
    calls: list[list[str]] = []
    fake_tools(monkeypatch, calls)
    stage = tmp_path / "stage"
    stage.mkdir()
    built = tb.maybe_build_trtllm(stage, manifest(), tb.TrtllmBuildOptions(gather_context_logits=True))
    assert built is not None and built.engine_dir == "trtllm" and built.version == "1.2.0"
    assert built.build_args["method"] == "convert_checkpoint+trtllm-build"
    convert, build = calls
    assert convert[:2] == [sys.executable, str(examples / "convert_checkpoint.py")]
    assert build[0] == "trtllm-build" and "--gather_context_logits" in build
    assert build[build.index("--max_seq_len") + 1] == "2048"


def test_llm_api_fallback_and_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TRTLLM_EXAMPLES_DIR", raising=False)
    monkeypatch.setattr(tb, "find_convert_script", lambda: None)
    calls: list[list[str]] = []
    fake_tools(monkeypatch, calls)
    built = tb.maybe_build_trtllm(tmp_path, manifest(), tb.TrtllmBuildOptions())
    assert built is not None and built.build_args["method"] == "llm-api"
    assert "_tensorrt_engine import LLM" in calls[0][2]

    def broken(cmd: list[str], timeout: float) -> Any:
        raise RuntimeError("trtllm-build failed")

    monkeypatch.setattr(tb, "_run", broken)
    assert tb.maybe_build_trtllm(tmp_path, manifest(), tb.TrtllmBuildOptions()) is None
    assert "FAILED" in capsys.readouterr().err
