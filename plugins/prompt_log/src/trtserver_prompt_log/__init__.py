"""OctoAI's ``log_prompt``: store a request's prompt only when the request says ``log_prompt: true``.

Where: ``ServerConfig.prompt_log_dir`` (``--prompt-log-dir``). Each asked-for request appends one
JSON line ``{"time", "request_id", "model", "prompt", "user"}`` to
``<dir>/prompts-YYYY-MM-DD.jsonl`` (UTC date). Nothing is stored for requests that do not ask.
A request that asks while no directory is configured gets a 400 (``param: log_prompt``), so a
client never believes its prompt was kept when it was not.

The write runs in a worker thread (the hook returns an awaitable), never on the event loop.

Retention: at start-up (``trtserver_app_created``) files ``prompts-YYYY-MM-DD.jsonl`` whose date is
more than ``TRTSERVER_PROMPT_LOG_RETENTION_DAYS`` days ago (default 30; 0 keeps nothing older than
today) are deleted. Long-running servers are expected to be restarted by deploys; an operator who
needs stricter retention runs a cleanup job on the same rule.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import threading
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from trtserver import hookimpl
from trtserver.errors import InvalidRequest
from trtserver.protocol import ChatCompletionRequest

if TYPE_CHECKING:
    from aiohttp import web

    from trtserver.config import ServerConfig
    from trtserver.protocol import CompletionRequest
    from trtserver.request_context import RequestContext

__version__ = "0.1.0"

RETENTION_ENV = "TRTSERVER_PROMPT_LOG_RETENTION_DAYS"
DEFAULT_RETENTION_DAYS = 30
PREFIX, SUFFIX = "prompts-", ".jsonl"

_lock = threading.Lock()
_encoder = msgspec.json.Encoder()


def retention_days() -> int:
    value = os.environ.get(RETENTION_ENV, "").strip()
    if not value:
        return DEFAULT_RETENTION_DAYS
    days = int(value)
    if days < 0:
        raise ValueError(f"{RETENTION_ENV} must be >= 0, got {days}")
    return days


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
    if config.prompt_log_dir:
        delete_expired(config.prompt_log_dir, retention_days(), dt.datetime.now(dt.timezone.utc).date())


@hookimpl
def trtserver_request_received(request: CompletionRequest | ChatCompletionRequest,
                               context: RequestContext) -> Awaitable[None] | None:
    if not request.log_prompt:
        return None
    directory = context.config.prompt_log_dir
    if not directory:
        raise InvalidRequest("prompt logging is not enabled on this server", param="log_prompt")
    now = dt.datetime.now(dt.timezone.utc)
    record = {"time": now.isoformat(), "request_id": context.request_id, "model": context.model or request.model,
              "user": context.user}
    if isinstance(request, ChatCompletionRequest):
        record["messages"] = msgspec.to_builtins(request.messages)
    else:
        record["prompt"] = request.prompt
    return asyncio.to_thread(append_record, directory, record, now)
