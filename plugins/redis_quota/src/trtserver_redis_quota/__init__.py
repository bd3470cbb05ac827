"""Per-project quotas (``service_tier``, the ``quotas`` table) held in Redis, so that every replica
behind a load balancer counts against the same requests-per-minute and tokens-per-minute windows.

Settings, in the server's TOML file (no table: this plugin stays out of the way)::

    [plugins.redis_quota]
    url = "rediss://:secret@redis.internal:6380/0"
    key_prefix = "prod:quota:"
    on_unavailable = "fail_open"   # or "fail_closed": 503 with Retry-After
    timeout_s = 1.0
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trtserver import hookimpl
from trtserver.plugins import plugin_settings
from trtserver_redis_quota.settings import RedisQuotaSettings
from trtserver_redis_quota.store import RedisQuotaStore

if TYPE_CHECKING:
    from trtserver.config import ServerConfig

__version__ = "0.1.0"
NAME = "redis_quota"

# stores made for a config, closed with its app
_open: dict[int, RedisQuotaStore] = {}


def settings_for(config: ServerConfig) -> RedisQuotaSettings | None:
    """The validated ``[plugins.redis_quota]`` table, or None when the config has none."""
    if not config.plugin_config(NAME):
        return None
    return plugin_settings(config, NAME, RedisQuotaSettings)


@hookimpl
def trtserver_app_created(app: Any, config: ServerConfig) -> None:
    """Validate the settings before anything starts (a bad one stops start-up, naming this plugin)."""
    if settings_for(config) is None:
        return

    async def close(_: Any) -> None:
        store = _open.pop(id(config), None)
        if store is not None:
            await store.aclose()

    app.on_cleanup.append(close)


@hookimpl
def trtserver_quota_store(config: ServerConfig) -> RedisQuotaStore | None:
    settings = settings_for(config)
    if settings is None:
        return None
    store = RedisQuotaStore(settings)
    _open[id(config)] = store
    return store
