"""``[plugins]`` in the TOML file: the modules to load (``load``) and one settings table per plugin,
beside ``--plugin`` on the command line."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest

from trtserver.cli import _add_serve_arguments, config_from_args
from trtserver.config import build_config
from trtserver.plugins import PluginConfigError, load_plugins, new_plugin_manager, plugin_settings


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _add_serve_arguments(parser)
    return parser.parse_args(list(argv))


TABLES = '''[server]
port = 7000

[plugins]
load = ["mod_one"]

[plugins.redis_quota]
url = "redis://127.0.0.1:6379/0"
timeout_s = 0.5

[plugins.other]
level = 3
'''


def test_plugins_table_beside_server(tmp_path: Path) -> None:
    path = tmp_path / "server.toml"
    path.write_text(TABLES)
    config = config_from_args(parse("engines/x", "--config", str(path), "--plugin", "two.py"))
    assert config.port == 7000 and config.plugins == ["mod_one", "two.py"]
    assert config.plugin_config("redis_quota") == {"url": "redis://127.0.0.1:6379/0", "timeout_s": 0.5}
    assert config.plugin_config("other") == {"level": 3} and config.plugin_config("absent") == {}
    config.plugin_config("other")["level"] = 4  # a copy: the config is not changed through it
    assert config.plugin_config("other") == {"level": 3}


def test_plugin_is_the_one_flag_for_the_load_list_and_keeps_the_settings(tmp_path: Path) -> None:
    path = tmp_path / "server.toml"
    path.write_text(TABLES)
    config = config_from_args(parse("engines/x", "--config", str(path), "--plugin", "a", "--plugin", "b.py"))
    assert config.plugins == ["mod_one", "a", "b.py"] and config.plugin_config("other") == {"level": 3}
    with pytest.raises(SystemExit):  # no second spelling of the same setting
        parse("engines/x", "--plugins", "a,b")


def test_plugins_table_in_a_file_without_server_and_the_old_list(tmp_path: Path) -> None:
    path = tmp_path / "flat.toml"
    path.write_text('port = 7001\n[plugins]\nload = ["m"]\n[plugins.x]\nk = "v"\n')
    config = config_from_args(parse("engines/x", "--config", str(path)))
    assert config.port == 7001 and config.plugins == ["m"] and config.plugin_config("x") == {"k": "v"}
    path.write_text('[server]\nplugins = ["m", "n"]\n')
    assert config_from_args(parse("engines/x", "--config", str(path))).plugins == ["m", "n"]
    assert build_config({"engine_dir": "e", "plugins": {"x": {"k": 1}}}).plugin_config("x") == {"k": 1}


@pytest.mark.parametrize("text", [
    '[server]\nplugins = ["m"]\n[plugins.x]\nk = 1\n',  # both places
    '[plugins]\nload = ["m"]\nstray = 1\n',  # neither `load` nor a table
])
def test_ambiguous_plugins_tables_fail(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"bad\.toml: .*plugins"):
        config_from_args(parse("engines/x", "--config", str(path)))


def test_load_must_be_a_list_of_names(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[plugins]\nload = "m"\n')
    with pytest.raises(msgspec.ValidationError, match=r"\$\.plugins"):
        config_from_args(parse("engines/x", "--config", str(path)))


class Settings(msgspec.Struct, forbid_unknown_fields=True):
    level: int = 1


def test_plugin_settings_validate_and_name_the_plugin() -> None:
    config = build_config({"engine_dir": "e", "plugins": {"other": {"level": 3}, "broken": {"level": "high"}}})
    assert plugin_settings(config, "other", Settings) == Settings(level=3)
    assert plugin_settings(config, "absent", Settings) == Settings()
    with pytest.raises(PluginConfigError, match=r"plugin 'broken': invalid settings in \[plugins\.broken\]: .*level"):
        plugin_settings(config, "broken", Settings)


def test_a_module_named_again_on_the_command_line_loads_once() -> None:
    """An installed plugin also named with ``--plugin`` (as the same module) is not registered twice."""
    pm = new_plugin_manager()
    load_plugins(pm, extra=["trtserver.builtins.quota_store"], allowlist=["trtserver.builtins.quota_store"])
    assert [name for name, _ in pm.list_name_plugin()].count("trtserver.builtins.quota_store") == 1
