"""pytest plugin for plugin authors (entry point ``pytest11``): fixtures that serve the real model.

    def test_my_plugin(trtserver_client_factory):
        client = await trtserver_client_factory(plugins=[my_plugin_module])
        response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})

The default engine directory is ``engines/SmolLM2-135M-Instruct`` under the current directory,
or ``$TRTSERVER_TEST_ENGINE_DIR``; build it with ``make engines``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

try:
    from pytest_asyncio import fixture as async_fixture
except ImportError:  # the plugin loads wherever trtserver is installed; the fixture needs pytest-asyncio
    async_fixture = pytest.fixture  # type: ignore[assignment]

DEFAULT_ENGINE_DIR = "engines/SmolLM2-135M-Instruct"


def default_engine_dir() -> Path:
    path = Path(os.environ.get("TRTSERVER_TEST_ENGINE_DIR", DEFAULT_ENGINE_DIR))
    if not (path / "trtserver.json").exists():
        raise RuntimeError(f"no engine directory at {path}: run `make engines` first "
                           "(or set TRTSERVER_TEST_ENGINE_DIR)")
    return path


async def wait_ready(app: Any, timeout: float = 120.0) -> None:
    from trtserver.server import STATE

    state = app[STATE]
    deadline = asyncio.get_running_loop().time() + timeout
    while not state.ready:
        if state.load_error is not None:
            raise RuntimeError(f"engine failed to load: {state.load_error}")
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("engine did not become ready")
        await asyncio.sleep(0.05)


@async_fixture
async def trtserver_client_factory() -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """Start an app (real default model, PyTorch engine) with extra plugins; returns an aiohttp
    ``TestClient``. Plugins are module objects, instances, or module names / file paths; other
    keyword arguments are ``ServerConfig`` settings. Needs pytest-asyncio."""
    from aiohttp.test_utils import TestClient, TestServer

    from trtserver.config import ServerConfig
    from trtserver.plugins import load_plugins, new_plugin_manager
    from trtserver.server import create_app

    clients: list[TestClient[Any, Any]] = []

    async def make(plugins: Iterable[object] = (), **settings: Any) -> TestClient[Any, Any]:
        settings.setdefault("engine_dir", str(default_engine_dir()))
        settings.setdefault("engine", "torch")
        # small KV cache: the app starts in seconds (the full 8k context x 16 slots takes longer)
        settings.setdefault("max_batch_size", 4)
        settings.setdefault("max_model_len", 1024)
        config = ServerConfig(**settings)
        pm = new_plugin_manager()
        names = [p for p in plugins if isinstance(p, str)]
        load_plugins(pm, extra=names + list(config.plugins), allowlist=config.plugin_allowlist)
        for plugin in plugins:
            if not isinstance(plugin, str):
                pm.register(plugin)
        client = TestClient(TestServer(create_app(config, pm)))
        await client.start_server()
        clients.append(client)
        await wait_ready(client.app)
        return client

    yield make
    for client in clients:
        await client.close()
