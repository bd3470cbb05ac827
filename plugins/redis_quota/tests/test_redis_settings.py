"""The ``[plugins.redis_quota]`` table: read through the hooks, validated, a bad one stops start-up."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import trtserver_redis_quota
from trtserver_redis_quota.settings import RedisQuotaSettings
from trtserver_redis_quota.store import RedisQuotaStore

from trtserver.cli import main
from trtserver.config import ServerConfig, build_config
from trtserver.plugins import PluginConfigError, load_plugins, new_plugin_manager


def config(**table: object) -> ServerConfig:
    return build_config({"engine_dir": "engines/x", "plugins": {"redis_quota": table} if table else []})


async def test_no_table_leaves_the_in_memory_store() -> None:
    pm = new_plugin_manager()
    load_plugins(pm, extra=["trtserver_redis_quota"], allowlist=["trtserver_redis_quota"])
    store = pm.hook.trtserver_quota_store(config=config())
    assert type(store).__name__ == "MemoryQuotaStore"


async def test_the_table_gives_a_redis_store() -> None:
    pm = new_plugin_manager()
    load_plugins(pm, extra=["trtserver_redis_quota"], allowlist=["trtserver_redis_quota"])
    store = pm.hook.trtserver_quota_store(config=config(url="redis://127.0.0.1:1/0", key_prefix="x:",
                                                        on_unavailable="fail_closed", timeout_s=0.1))
    try:
        assert isinstance(store, RedisQuotaStore)
        assert store.settings == RedisQuotaSettings(url="redis://127.0.0.1:1/0", key_prefix="x:",
                                                    on_unavailable="fail_closed", timeout_s=0.1)
        assert store.keys("acme") == ("x:{acme}:requests", "x:{acme}:tokens", "x:{acme}:token_sum")
    finally:
        await store.aclose()


@pytest.mark.parametrize(("table", "named"), [
    ({"url": "redis://h", "on_unavailable": "fail_later"}, "$.on_unavailable"),
    ({"url": "redis://h", "timeout_s": 0}, "$.timeout_s"),
    ({"url": "http://h"}, "url must start with"),
    ({"url": "redis://h", "prefix": "x"}, "prefix"),
    ({"key_prefix": "x"}, "url"),
])
def test_bad_settings_name_the_plugin_and_the_setting(table: dict[str, object], named: str) -> None:
    with pytest.raises(PluginConfigError) as error:
        trtserver_redis_quota.settings_for(config(**table))
    message = str(error.value)
    assert message.startswith("plugin 'redis_quota': invalid settings in [plugins.redis_quota]: ") and named in message


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """``serve`` configures structlog to write to the (captured) stderr of the moment."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.mark.usefixtures("logging_restored")
def test_a_bad_table_stops_serve_before_the_engine_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "server.toml"
    path.write_text('[server]\nport = 1\n\n[plugins]\nload = ["trtserver_redis_quota"]\n\n'
                    '[plugins.redis_quota]\nurl = "redis://127.0.0.1:1/0"\non_unavailable = "maybe"\n')
    assert main(["serve", str(tmp_path / "no-engine"), "--config", str(path)]) == 3
    err = capsys.readouterr().err
    assert "plugin 'redis_quota': invalid settings in [plugins.redis_quota]" in err and "on_unavailable" in err
