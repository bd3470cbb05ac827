"""The engine directory carries the model's chat template, named by the manifest, from a GGUF or a checkpoint."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from build_engines.cli import add_build_arguments, run_build
from build_engines.synthetic import write_tiny_hf_checkpoint
from trtserver.chat_template import ChatTemplate, read_engine_dir_template
from trtserver.manifest import load_manifest


def build(model: Path, out: Path) -> Path:
    parser = argparse.ArgumentParser()
    add_build_arguments(parser)
    return run_build(parser.parse_args(["--model", str(model), "--out", str(out), "--dtype", "float32"]))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    write_tiny_hf_checkpoint(path, torch_dtype="float32")
    return path


def with_tokenizer_config(checkpoint: Path, target: Path, **fields: object) -> Path:
    import shutil

    shutil.copytree(checkpoint, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, **fields}))
    return target


def test_string_template_from_tokenizer_config(checkpoint: Path, tmp_path: Path) -> None:
    model = with_tokenizer_config(checkpoint, tmp_path / "a", chat_template="{{ bos_token }}{{ messages[0].content }}")
    engine_dir = build(model, tmp_path / "out")
    assert load_manifest(engine_dir).chat_template == "chat_template.jinja"
    assert (engine_dir / "chat_template.jinja").read_text() == "{{ bos_token }}{{ messages[0].content }}"
    found = read_engine_dir_template(engine_dir)
    assert found is not None and found[1] == str(engine_dir / "chat_template.jinja")
    rendered = ChatTemplate.from_text(found[0], special_tokens={"bos_token": "<|im_start|>"}).render(
        [{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>hi"


def test_named_templates_take_default(checkpoint: Path, tmp_path: Path) -> None:
    model = with_tokenizer_config(checkpoint, tmp_path / "b", chat_template=[
        {"name": "rag", "template": "rag"}, {"name": "default", "template": "the default"}])
    engine_dir = build(model, tmp_path / "out")
    assert (engine_dir / "chat_template.jinja").read_text() == "the default"


def test_chat_template_jinja_wins_and_is_kept(checkpoint: Path, tmp_path: Path) -> None:
    model = with_tokenizer_config(checkpoint, tmp_path / "c", chat_template="from config")
    (model / "chat_template.jinja").write_text("from jinja\n")
    engine_dir = build(model, tmp_path / "out")
    assert load_manifest(engine_dir).chat_template == "chat_template.jinja"
    assert (engine_dir / "chat_template.jinja").read_text() == "from jinja\n"


def test_no_template_no_file(checkpoint: Path, tmp_path: Path) -> None:
    engine_dir = build(checkpoint, tmp_path / "out")
    assert load_manifest(engine_dir).chat_template is None
    assert not (engine_dir / "chat_template.jinja").exists()
    assert read_engine_dir_template(engine_dir) is None
