"""OctoAI's ``log_prompt``: store a request's prompt only when the request says ``log_prompt: true``.

Settings, in the server's TOML file (no table: prompt logging is off)::

    [plugins.prompt_log]
    dir = "/var/log/trtserver/prompts"
    retention_days = 30

Each asked-for request appends one
JSON line ``{"time", "request_id", "model", "prompt", "user"}`` to
``<dir>/prompts-YYYY-MM-DD.jsonl`` (UTC date). Nothing is stored for requests that do not ask.
A request that asks while no directory is configured gets a 400 (``param: log_prompt``), so a
client never believes its prompt was kept when it was not.

The write runs in a worker thread (the hook returns an awaitable), never on the event loop.

Retention: at start-up (``trtserver_app_created``) files ``prompts-YYYY-MM-DD.jsonl`` whose date is
more than ``retention_days`` days ago (default 30; 0 keeps nothing older than today) are deleted;
a bad table stops start-up, naming the setting. Long-running servers are expected to be restarted
by deploys; an operator who needs stricter retention runs a cleanup job on the same rule.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from trtserver import hookimpl
from trtserver.errors import InvalidRequest
from trtserver.plugins import plugin_settings
from trtserver.protocol import ChatCompletionRequest

if TYPE_CHECKING:
    from aiohttp import web

    from trtserver.config import ServerConfig
    from trtserver.protocol import CompletionRequest
    from trtserver.request_context import RequestContext

__version__ = "0.1.0"

NAME = "prompt_log"
PREFIX, SUFFIX = "prompts-", ".jsonl"

_lock = threading.Lock()
_encoder = msgspec.json.Encoder()


class PromptLogSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    dir: Annotated[str, msgspec.Meta(min_length=1)]
    retention_days: Annotated[int, msgspec.Meta(ge=0)] = 30


def settings_for(config: ServerConfig) -> PromptLogSettings | None:
    """The validated ``[plugins.prompt_log]`` table, or None when the config has none."""
    if not config.plugin_config(NAME):
        return None
    return plugin_settings(config, NAME, PromptLogSettings)


def log_path(directory: str | Path, now: dt.datetime) -> Path:
    return Path(directory) / f"{PREFIX}{now:%Y-%m-%d}{SUFFIX}"


def delete_expired(directory: str | Path, days: int, today: dt.date) -> list[Path]:
    """Delete ``prompts-YYYY-MM-DD.jsonl`` files dated before ``today - days``; returns them."""
    cutoff = today - dt.timedelta(days=days)
    deleted = []
    for path in Path(directory).glob(f"{PREFIX}*{SUFFIX}"):
        try:
            day = dt.date.fromisoformat(path.name[len(PREFIX):-len(SUFFIX)])
        except ValueError:
            continue  # not one of ours
        if day < cutoff:
            path.unlink(missing_ok=True)
            deleted.append(path)
    return deleted


def append_record(directory: str, record: dict[str, Any], now: dt.datetime) -> None:
    line = _encoder.encode(record) + b"\n"
    path = log_path(directory, now)
    with _lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as f:
            f.write(line)


@hookimpl
def trtserver_app_created(app: web.Application, config: ServerConfig) -> None:
    """Validate the settings before anything starts, then drop the expired files."""
    settings = settings_for(config)
    if settings is not None:
        delete_expired(settings.dir, settings.retention_days, dt.datetime.now(dt.timezone.utc).date())


@hookimpl
def trtserver_request_received(request: CompletionRequest | ChatCompletionRequest,
                               context: RequestContext) -> Awaitable[None] | None:
    if not request.log_prompt:
        return None
    settings = settings_for(context.config)
    if settings is None:
        raise InvalidRequest("prompt logging is not enabled on this server", param="log_prompt")
    now = dt.datetime.now(dt.timezone.utc)
    record: dict[str, Any] = {"time": now.isoformat(), "request_id": context.request_id,
                              "model": context.model or request.model, "user": context.user}
    if isinstance(request, ChatCompletionRequest):
        record["messages"] = msgspec.to_builtins(request.messages)
    else:
        record["prompt"] = request.prompt
    return asyncio.to_thread(append_record, settings.dir, record, now)
