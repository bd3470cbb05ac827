"""The playground: a web page at ``/playground/`` for trying the served model in a browser.

It adds routes through ``trtserver_app_created`` and nothing else: ``GET /`` and ``GET /playground``
redirect to ``/playground/``, which serves ``static/index.html``; each other file in ``static/``
is served under ``/playground/<name>``. The page talks to the server only through the public API
(``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, ``/metrics``), sending the API key
the user typed, so the page's own files are open paths: they need no key, the API calls do.

``enabled = false`` in the config file's ``[plugins.playground]`` table turns the page off on a
server where the plugin is installed; uninstalling the package does the same.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path

import msgspec
from aiohttp import web

from trtserver import hookimpl
from trtserver.config import ServerConfig
from trtserver.http.app import STATE
from trtserver.plugins import plugin_settings

__version__ = "0.1.0"

PREFIX = "/playground/"
# the files change with the installed package, not between requests; revalidate so an upgrade shows at once
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


class Settings(msgspec.Struct, forbid_unknown_fields=True):
    enabled: bool = True


def enabled(config: ServerConfig) -> bool:
    return plugin_settings(config, "playground", Settings).enabled


def static_files() -> dict[str, Path]:
    """URL path -> file, for every file the package ships; the index answers at the prefix itself."""
    directory = Path(str(resources.files(__name__) / "static"))
    files = {PREFIX + path.name: path for path in sorted(directory.iterdir()) if path.is_file()}
    files[PREFIX] = directory / "index.html"
    return files


def _file_handler(path: Path) -> Callable[[web.Request], Awaitable[web.FileResponse]]:
    async def handler(request: web.Request) -> web.FileResponse:
        return web.FileResponse(path, headers=HEADERS)

    return handler


async def _to_playground(request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound(PREFIX)


@hookimpl
def trtserver_app_created(app: web.Application, config: ServerConfig) -> None:
    if not enabled(config):
        return
    files = static_files()
    app.router.add_get("/", _to_playground)
    app.router.add_get(PREFIX.rstrip("/"), _to_playground)
    for url, path in files.items():
        app.router.add_get(url, _file_handler(path))
    app[STATE].open_paths.update({"/", PREFIX.rstrip("/"), *files})
