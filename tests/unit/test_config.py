from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest

from trtserver.cli import _add_serve_arguments, config_from_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_map_onto_config() -> None:
    config = config_from_args(parse("engines/x", "--port", "9000", "--max-logprobs", "20", "--no-cuda-graphs",
                                    "--api-keys", "a,b", "--plugin", "mod_one", "--plugin", "two.py",
                                    "--request-timeout-s", "2.5"))
    assert config.engine_dir == "engines/x" and config.port == 9000 and config.max_logprobs == 20
    assert config.cuda_graphs is False and config.api_keys == ["a", "b"]
    assert config.plugins == ["mod_one", "two.py"] and config.request_timeout_s == 2.5


def test_toml_file_with_flags_winning(tmp_path: Path) -> None:
    path = tmp_path / "server.toml"
    path.write_text('[server]\nport = 7000\nmax_n = 4\n[server.quotas.default]\nrequests_per_minute = 10\n')
    config = config_from_args(parse("engines/x", "--config", str(path), "--port", "7100"))
    assert config.port == 7100 and config.max_n == 4
    assert config.quotas["default"].requests_per_minute == 10


def test_invalid_settings_fail(tmp_path: Path) -> None:
    with pytest.raises(msgspec.ValidationError):
        config_from_args(parse("engines/x", "--max-batch-size", "0"))
    path = tmp_path / "bad.toml"
    path.write_text("[server]\nno_such_setting = 1\n")
    with pytest.raises(msgspec.ValidationError):
        config_from_args(parse("engines/x", "--config", str(path)))


def _description(prop: dict[str, object]) -> object:
    """A property's description, on it or on the one non-null member of an optional (``X | None``)."""
    if prop.get("description"):
        return prop["description"]
    members = [m for m in prop.get("anyOf", []) if isinstance(m, dict) and m.get("type") != "null"]  # type: ignore[attr-defined]
    return members[0].get("description") if len(members) == 1 else None


def test_every_setting_has_a_description() -> None:
    from trtserver.config import ServerConfig

    _, components = msgspec.json.schema_components([ServerConfig])
    properties = components["ServerConfig"]["properties"]
    assert [name for name, prop in properties.items() if not _description(prop)] == []
