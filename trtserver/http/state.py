"""What the running app holds, and the keys it is found under on the app and on each request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pluggy
from aiohttp import web

from trtserver.config import ServerConfig
from trtserver.engine.base import Engine
from trtserver.http.metrics import Metrics
from trtserver.serving import Service

# paths answered without an API key (a plugin serving a page adds its own to ServerState.open_paths)
OPEN_PATHS: frozenset[str] = frozenset({"/health", "/metrics"})


@dataclass(slots=True)
class ServerState:
    """What the running app holds; one per app, under ``STATE``."""

    config: ServerConfig
    pm: pluggy.PluginManager
    engine: Engine | None = None
    service: Service | None = None
    ready: bool = False
    load_error: str | None = None
    draining: bool = False
    started_at: float = field(default_factory=time.time)
    in_flight: int = 0
    engine_task: asyncio.Task[None] | None = None
    metrics: Metrics | None = None
    # `trtserver serve` sets it (to pin the event loop): what runs once the engine has started
    engine_started: Callable[[Engine], None] | None = None
    # paths answered without an API key; a plugin serving a web page adds its own (its API calls carry the key)
    open_paths: set[str] = field(default_factory=lambda: set(OPEN_PATHS))
    # every request being handled, by the task that handles it (``end_requests`` cuts them off)
    handling: dict[asyncio.Task[object], web.Request] = field(default_factory=dict)
    cut_off: bool = False


STATE = web.AppKey("trtserver_state", ServerState)
REQUEST_ID = web.RequestKey("trtserver_request_id", str)
# an SSE response once its headers are out (what a cut-off request's last events go on)
EVENT_STREAM = web.RequestKey("trtserver_event_stream", web.StreamResponse)
MAX_REQUEST_ID_CHARS = 256
