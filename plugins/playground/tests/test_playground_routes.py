"""The plugin's routes on an app whose engine never finishes loading: no model needed."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import trtserver_playground
from aiohttp.test_utils import TestClient, TestServer

from trtserver import hookimpl
from trtserver.config import ServerConfig
from trtserver.http.app import create_app
from trtserver.plugins import new_plugin_manager


class _Loading:
    async def start(self) -> None:
        await asyncio.Event().wait()


class NeverReady:
    """An engine that is still loading: the page's files must not wait for it."""

    @hookimpl
    def trtserver_register_engines(self, register: Callable[[str, Callable[[ServerConfig], Any]], None]) -> None:
        register("loading", lambda config: _Loading())


async def client_for(**settings: Any) -> TestClient[Any, Any]:
    pm = new_plugin_manager()
    pm.register(NeverReady())
    pm.register(trtserver_playground, name="playground")
    config = ServerConfig(engine_dir="unused", engine="loading", **settings)
    client = TestClient(TestServer(create_app(config, pm)))
    await client.start_server()
    return client


@pytest.fixture
async def client() -> AsyncIterator[TestClient[Any, Any]]:
    client = await client_for()
    yield client
    await client.close()


async def test_root_redirects_to_the_page(client: TestClient[Any, Any]) -> None:
    for path in ("/", "/playground"):
        response = await client.get(path, allow_redirects=False)
        assert response.status == 302 and response.headers["Location"] == "/playground/"
    response = await client.get("/")
    assert response.status == 200 and str(response.url).endswith("/playground/")


async def test_page_and_its_files(client: TestClient[Any, Any]) -> None:
    response = await client.get("/playground/")
    assert response.status == 200 and response.content_type == "text/html"
    html = await response.text()
    assert 'src="playground.js"' in html and 'href="playground.css"' in html
    for name, kind in (("playground.js", "text/javascript"), ("playground.css", "text/css"),
                       ("index.html", "text/html")):
        response = await client.get(f"/playground/{name}")
        assert response.status == 200, name
        assert response.content_type in (kind, "application/javascript"), (name, response.content_type)
        assert response.headers["Cache-Control"] == "no-cache"
        # offline machines: nothing may come from another host
        text = await response.text()
        assert "http://" not in text and "https://" not in text, name
    assert (await client.get("/playground/missing.js")).status == 404


async def test_files_come_from_the_package() -> None:
    files = trtserver_playground.static_files()
    assert set(files) == {"/playground/", "/playground/index.html", "/playground/playground.js",
                          "/playground/playground.css"}
    assert all(path.is_file() for path in files.values())


async def test_page_needs_no_key_but_the_api_does() -> None:
    client = await client_for(api_keys=["k-1"])
    try:
        assert (await client.get("/playground/")).status == 200
        assert (await client.get("/playground/playground.js")).status == 200
        assert (await client.get("/", allow_redirects=False)).status == 302
        assert (await client.get("/v1/models")).status == 401
        assert (await client.post("/v1/completions", json={"prompt": "x"})).status == 401
        assert (await client.get("/openapi.json")).status == 401
    finally:
        await client.close()


async def test_setting_turns_it_off() -> None:
    off = {"playground": {"enabled": False}}
    client = await client_for(api_keys=["k-1"], plugin_settings=off)
    try:
        assert (await client.get("/playground/")).status == 401  # no such open path any more
    finally:
        await client.close()
    client = await client_for(plugin_settings={"playground": {"enabled": True}})
    try:
        assert (await client.get("/playground/")).status == 200
    finally:
        await client.close()
    client = await client_for(plugin_settings=off)
    try:
        assert (await client.get("/playground/")).status == 404
        assert (await client.get("/")).status == 404
    finally:
        await client.close()


def test_listed_by_trtserver_plugins() -> None:
    out = subprocess.run([sys.executable, "-m", "trtserver.cli", "plugins", "--json"], capture_output=True,
                         text=True, check=True)
    assert '"playground"' in out.stdout and "trtserver_app_created" in out.stdout
