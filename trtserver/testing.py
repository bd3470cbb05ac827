"""pytest plugin for plugin authors (entry point ``pytest11``): fixtures that serve the app.

``trtserver_scripted_client_factory`` serves a scripted engine (``trtserver.scripted_engine``): a
tiny synthetic model whose output the test writes, ready in milliseconds, no model needed::

    from trtserver.scripted_engine import reply

    async def test_my_plugin(trtserver_scripted_client_factory):
        client = await trtserver_scripted_client_factory(plugins=[my_plugin_module], script=reply(" Paris"))
        response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})

``trtserver_client_factory`` serves the real default model: ``engines/SmolLM2-135M-Instruct``
under the current directory, or ``$TRTSERVER_TEST_ENGINE_DIR``; build it with ``make engines``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from trtserver.http.connection import GuardedAppRunner

if TYPE_CHECKING:
    from trtserver.scripted_engine import Script, ScriptedEngine

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
    from trtserver.http.app import STATE

    state = app[STATE]
    deadline = asyncio.get_running_loop().time() + timeout
    while not state.ready:
        if state.load_error is not None:
            raise RuntimeError(f"engine failed to load: {state.load_error}")
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("engine did not become ready")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def serve(plugins: Iterable[object] = (), *, installed_plugins: bool = True,
                **settings: Any) -> AsyncIterator[TestClient[Any, Any]]:
    """An app on the real default model (PyTorch engine), as an aiohttp ``TestClient``, ready to serve.

    ``plugins`` are module objects, instances, or module names / file paths. With
    ``installed_plugins=False`` only those load (no entry points), so a test sees its own plugin
    alone. Other keyword arguments are ``ServerConfig`` settings. Use it for module-scoped apps::

        @pytest_asyncio.fixture(scope="module")
        async def client():
            async with serve([my_plugin], installed_plugins=False) as client:
                yield client
    """
    settings.setdefault("engine_dir", str(default_engine_dir()))
    settings.setdefault("engine", "torch")
    # small KV cache: the app starts in seconds (the full 8k context x 16 slots takes longer)
    settings.setdefault("max_batch_size", 4)
    settings.setdefault("max_model_len", 1024)
    async with _serve_app(plugins, installed_plugins, settings) as client:
        yield client


@contextlib.asynccontextmanager
async def serve_scripted(plugins: Iterable[object] = (), *, script: Script | None = None,
                         step_delay_s: float = 0.0, installed_plugins: bool = True,
                         **settings: Any) -> AsyncIterator[TestClient[Any, Any]]:
    """An app on a scripted engine (see ``trtserver.scripted_engine``), ready to serve, as ``serve`` is.

    ``script`` says what each sequence generates (default: ``echo``, the prompt's text, then EOS);
    ``step_delay_s`` is slept after each step of every request (to test time-outs and disconnects).
    ``engine`` may name another registered engine that reads the same directory.
    The engine directory is the synthetic model's, written to a temporary folder.
    ``scripted_engine(client)`` is the engine (its ``requests`` are what the server asked of it).
    """
    from trtserver.scripted_engine import ENGINE_NAME, ScriptedEngines, echo, write_engine_dir

    engines = ScriptedEngines(script or echo, step_delay_s=step_delay_s)
    with tempfile.TemporaryDirectory(prefix="trtserver-scripted-") as folder:
        settings.setdefault("engine_dir", str(write_engine_dir(folder)))
        settings.setdefault("engine", ENGINE_NAME)
        settings.setdefault("max_batch_size", 4)
        async with _serve_app([*plugins, engines], installed_plugins, settings) as client:
            yield client


def scripted_engine(client: TestClient[Any, Any]) -> ScriptedEngine:
    """The engine behind an app that ``serve_scripted`` started."""
    from trtserver.http.app import STATE
    from trtserver.scripted_engine import ScriptedEngine

    engine = client.app[STATE].engine
    if not isinstance(engine, ScriptedEngine):
        raise TypeError(f"this app serves {type(engine).__name__}, not a scripted engine")
    return engine


class GuardedTestServer(TestServer):
    """aiohttp's ``TestServer`` on the server's own connections (``http.connection``), so the errors aiohttp
    answers before any middleware (a bad chunk size, a head too slow) are the JSON envelope here too."""

    def __init__(self, app: web.Application, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout_s = header_timeout_s

    async def _make_runner(self, **kwargs: Any) -> web.AppRunner:
        return GuardedAppRunner(self.app, header_timeout_s=self._header_timeout_s, **kwargs)


@contextlib.asynccontextmanager
async def _serve_app(plugins: Iterable[object], installed_plugins: bool,
                     settings: dict[str, Any]) -> AsyncIterator[TestClient[Any, Any]]:
    from trtserver.config import ServerConfig
    from trtserver.http.app import create_app
    from trtserver.plugins import load_plugins, new_plugin_manager

    plugins = list(plugins)
    config = ServerConfig(**settings)
    pm = new_plugin_manager()
    names = [p for p in plugins if isinstance(p, str)] + list(config.plugins)
    allowlist = config.plugin_allowlist if installed_plugins else [
        Path(name).stem if name.endswith(".py") else name for name in names]
    load_plugins(pm, extra=names, allowlist=allowlist)
    for plugin in plugins:
        if not isinstance(plugin, str):
            pm.register(plugin)
    client = TestClient(GuardedTestServer(create_app(config, pm), header_timeout_s=config.header_timeout_s))
    await client.start_server()
    try:
        await wait_ready(client.app)
        yield client
    finally:
        await client.close()


@async_fixture
async def trtserver_client_factory() -> AsyncIterator[Callable[..., Awaitable[TestClient[Any, Any]]]]:
    """A function-scoped factory over ``serve``: ``await factory(plugins, **settings)`` gives a
    ready ``TestClient``; every app it started is closed after the test. Needs pytest-asyncio."""
    async with contextlib.AsyncExitStack() as stack:

        async def make(plugins: Iterable[object] = (), **settings: Any) -> TestClient[Any, Any]:
            return await stack.enter_async_context(serve(plugins, **settings))

        yield make


@async_fixture
async def trtserver_scripted_client_factory() -> AsyncIterator[Callable[..., Awaitable[TestClient[Any, Any]]]]:
    """A function-scoped factory over ``serve_scripted``: ``await factory(plugins, script=..., **settings)``
    gives a ready ``TestClient`` on a scripted engine; every app it started is closed after the test.
    Needs pytest-asyncio."""
    async with contextlib.AsyncExitStack() as stack:

        async def make(plugins: Iterable[object] = (), **settings: Any) -> TestClient[Any, Any]:
            return await stack.enter_async_context(serve_scripted(plugins, **settings))

        yield make
