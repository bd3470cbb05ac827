"""Two real trtserver replicas sharing quotas in a real redis-server, behind a real nginx.

Everything listens on loopback ports picked free, keeps its files in a temporary directory and is
stopped at the end of the module. ``-m "not replicas"`` leaves these tests out.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from trtserver_redis_quota.testing import RedisServer

from tests.http.conftest import wait_healthy
from tests.replicas.deployment import Deployment, Nginx, Replica, replica_config


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "replicas: replicas behind nginx, quotas in redis-server (real processes)")


@pytest.fixture(scope="module")
def deployment(engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("replicas")
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    with RedisServer(root / "redis") as redis_server:
        # the two replicas differ in one setting only, so that a Redis outage shows both behaviours
        replicas = [Replica(engine_dir, replica_config(root / f"{name}.toml", redis_server.url, prefix, name),
                            root / f"{name}.log") for name in ("fail_open", "fail_closed")]
        nginx: Nginx | None = None
        try:
            for replica in replicas:
                wait_healthy(replica.base, replica.process, timeout=180)
            nginx = Nginx(root / "nginx", [replica.address for replica in replicas])
            yield Deployment(redis_server, prefix, replicas[0], replicas[1], nginx)
        finally:
            if nginx is not None:
                nginx.stop()
            for replica in replicas:
                replica.stop()
