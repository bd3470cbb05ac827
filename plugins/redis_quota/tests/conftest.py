from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from trtserver_redis_quota.settings import RedisQuotaSettings
from trtserver_redis_quota.store import RedisQuotaStore
from trtserver_redis_quota.testing import RedisServer


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA)."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    return cert, key, cert


@pytest_asyncio.fixture
async def make_store() -> AsyncIterator[Callable[..., RedisQuotaStore]]:
    """``make_store(url, **settings)``: stores closed after the test. Unless a test sets it, the
    timeout is long: a loaded machine must not turn a slow answer into an outage."""
    stores: list[RedisQuotaStore] = []

    def make(url: str, **settings: object) -> RedisQuotaStore:
        settings.setdefault("timeout_s", 10.0)
        store = RedisQuotaStore(RedisQuotaSettings(url=url, **settings))  # type: ignore[arg-type]
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.aclose()
