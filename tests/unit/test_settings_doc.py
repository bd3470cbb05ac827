"""One source for every setting: each ServerConfig field describes itself, `serve --help` shows it,
and docs/settings.md is generated from it."""

from __future__ import annotations

import argparse
import importlib.util
import typing
from pathlib import Path

import msgspec
import pytest

from trtserver.cli import _add_serve_arguments, settings
from trtserver.config import ServerConfig

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "settings.md"
FIELDS = [f.name for f in msgspec.structs.fields(ServerConfig)]


def gen_settings_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("trtserver_docs_gen_settings", REPO / "docs" / "gen_settings.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", FIELDS)
def test_every_field_has_a_one_line_description(name: str) -> None:
    setting = next(s for s in settings() if s.name == name)
    assert setting.description.strip(), (
        f"ServerConfig.{name} has no description: declare it as Annotated[..., Meta(description=...)]")
    assert "\n" not in setting.description


def test_settings_strip_annotations_but_keep_types_and_defaults() -> None:
    by_name = {s.name: s for s in settings()}
    assert by_name["cuda_graphs"].kind is bool and by_name["cuda_graphs"].default is True
    assert typing.get_origin(by_name["log_format"].kind) is typing.Literal
    assert by_name["max_batch_size"].kind is int and by_name["max_batch_size"].default == 16
    assert by_name["api_keys"].default == [] and by_name["engine_dir"].default is msgspec.NODEFAULT
    assert by_name["quotas"].flag is None and by_name["max_n"].flag == "--max-n"


def test_serve_help_describes_every_flag() -> None:
    parser = argparse.ArgumentParser()
    _add_serve_arguments(parser)
    helps = {action.dest: action.help for action in parser._actions}
    for setting in settings():
        if setting.flag is None:
            continue
        assert helps.get(setting.name), f"--{setting.name} has no help"
        assert setting.description.replace("%", "%%") in str(helps[setting.name])
    assert "(default: 16)" in str(helps["max_batch_size"]) and "(default: on)" in str(helps["cuda_graphs"])


def test_constraints_still_apply_after_adding_descriptions() -> None:
    with pytest.raises(msgspec.ValidationError, match="max_model_len"):
        msgspec.convert({"engine_dir": "x", "max_model_len": 0}, ServerConfig)
    with pytest.raises(msgspec.ValidationError, match="request_timeout_s"):
        msgspec.convert({"engine_dir": "x", "request_timeout_s": 0}, ServerConfig)
    assert msgspec.convert({"engine_dir": "x", "max_model_len": None}, ServerConfig).max_model_len is None


def test_settings_page_is_generated_and_lists_every_field() -> None:
    gen = gen_settings_module()
    text = DOC.read_text()
    assert gen.render(text) == text, "docs/settings.md is stale: run python docs/gen_settings.py"
    for name in FIELDS:
        assert f"| `{name}` |" in text or name == "engine_dir"
    assert "| `--max-batch-size` | `max_batch_size` | int ≥ 1 | `16` |" in text
    assert "| (TOML only) | `quotas` | table |" in text


def test_a_field_without_description_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    class Undocumented(msgspec.Struct, kw_only=True):
        engine_dir: str
        port: typing.Annotated[int, msgspec.Meta(ge=1)] = 8000

    monkeypatch.setattr("trtserver.cli.ServerConfig", Undocumented)
    assert [s.description for s in settings()] == ["", ""]
