"""Service tiers (Nebius ``service_tier``) and per-project quotas.

A request names a tier and, with the ``ai_project_id`` query parameter, a project. Each project has
requests/min and tokens/min limits (the ``quotas`` table of the config; key ``default`` for every
project without its own). The counts live in a ``QuotaStore``: in memory by default, anything
shared through the ``trtserver_quota_store`` hook.

| tier      | counts | over quota                       | engine priority |
|-----------|--------|----------------------------------|-----------------|
| default   | yes    | 429 with Retry-After             | normal          |
| auto      | yes    | served as ``over-limit``, later  | normal / low    |
| flex      | no     | never; 429 when its queue is full| lowest          |
| no-limit  | no     | never; only for configured keys  | high            |
| over-limit| cannot be requested (400)                             |
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Awaitable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol

from trtserver.config import ServerConfig, TierLimits
from trtserver.engine.base import Priority
from trtserver.errors import InvalidRequest, PermissionDenied, RateLimited

WINDOW_S = 60.0
MAX_PROJECT_ID_CHARS = 128


@dataclass(frozen=True, slots=True)
class QuotaDecision:
    allowed: bool
    remaining_requests: int | None
    remaining_tokens: int | None
    retry_after_s: float = 0.0


class QuotaStore(Protocol):
    """Counts per project over a sliding minute. Methods may be async (return awaitables).

    A store may also define ``refund(project, at)``, giving back the request ``acquire`` counted at
    ``at``: a request refused as invalid after it was counted then costs its project nothing."""

    def acquire(self, project: str, limits: TierLimits, now: float) -> QuotaDecision | Awaitable[QuotaDecision]:
        """Decide whether one more request fits; count it when it does."""

    def add_tokens(self, project: str, tokens: int, now: float) -> Awaitable[None] | None:
        """Charge tokens used by a finished request."""


# the quota counts this request took so far, in the request's own context (see ``track_counts``)
_counted: ContextVar[list[tuple[QuotaStore, str, float]] | None] = ContextVar("trtserver_quota_counted",
                                                                              default=None)


def track_counts() -> None:
    """Begin recording, for the request running in this context, what ``decide_tier`` counts."""
    _counted.set([])


async def refund_counts() -> None:
    """Give back every request count recorded since ``track_counts`` (the request was refused)."""
    from trtserver.plugins import await_me_maybe

    counted = _counted.get()
    if not counted:
        return
    _counted.set([])
    for store, project, at in counted:
        refund = getattr(store, "refund", None)  # optional in the QuotaStore protocol
        if refund is not None:
            await await_me_maybe(refund(project, at))


@dataclass(slots=True)
class _Window:
    """One project's last minute: request times, (time, tokens) charges, and when it was last used."""

    requests: collections.deque[float] = field(default_factory=collections.deque)
    tokens: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)
    used_tokens: int = 0
    last_used: float = 0.0

    def trim(self, now: float) -> None:
        while self.requests and self.requests[0] <= now - WINDOW_S:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.used_tokens -= self.tokens.popleft()[1]


class MemoryQuotaStore:
    """One process's counts; replicas each keep their own (use a shared store to pool them).

    At most ``max_projects`` windows are kept: a window idle for a whole minute holds no counts and
    is forgotten; past the bound the least recently used one is dropped too."""

    def __init__(self, max_projects: int = 10_000) -> None:
        self.max_projects = max_projects
        self._windows: collections.OrderedDict[str, _Window] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._windows)

    def _window(self, project: str, now: float) -> _Window:
        windows = self._windows
        while windows:  # oldest first: stop at the first one still inside the minute
            oldest = next(iter(windows.values()))
            if oldest.last_used > now - WINDOW_S:
                break
            windows.popitem(last=False)
        window = windows.get(project)
        if window is None:
            if len(windows) >= self.max_projects:
                windows.popitem(last=False)
            window = windows[project] = _Window()
        else:
            windows.move_to_end(project)
        window.last_used = max(window.last_used, now)
        window.trim(now)
        return window

    def acquire(self, project: str, limits: TierLimits, now: float) -> QuotaDecision:
        window = self._window(project, now)
        requests, tokens = window.requests, window.tokens
        left_requests = None if limits.requests_per_minute is None else limits.requests_per_minute - len(requests)
        left_tokens = None if limits.tokens_per_minute is None else limits.tokens_per_minute - window.used_tokens
        if (left_requests is not None and left_requests <= 0) or (left_tokens is not None and left_tokens <= 0):
            firsts = ([requests[0]] if requests else []) + ([tokens[0][0]] if tokens else [])
            oldest = min(firsts, default=now)
            return QuotaDecision(False, max(left_requests or 0, 0), max(left_tokens or 0, 0),
                                 retry_after_s=max(oldest + WINDOW_S - now, 1.0))
        requests.append(now)
        return QuotaDecision(True, None if left_requests is None else left_requests - 1, left_tokens)

    def add_tokens(self, project: str, tokens: int, now: float) -> None:
        window = self._window(project, now)
        window.tokens.append((now, tokens))
        window.used_tokens += tokens

    def refund(self, project: str, at: float) -> None:
        """Give back the request ``acquire`` counted at ``at`` (it was refused as invalid)."""
        window = self._windows.get(project)
        if window is not None and at in window.requests:
            window.requests.remove(at)


@dataclass(frozen=True, slots=True)
class TierDecision:
    tier: str  # what the response says
    priority: Priority
    project: str | None
    counted: bool
    headers: dict[str, str]


def limits_for(config: ServerConfig, project: str) -> TierLimits | None:
    return config.quotas.get(project) or config.quotas.get("default")


def quota_headers(decision: QuotaDecision) -> dict[str, str]:
    headers = {}
    if decision.remaining_requests is not None:
        headers["x-ratelimit-remaining-requests"] = str(max(decision.remaining_requests, 0))
    if decision.remaining_tokens is not None:
        headers["x-ratelimit-remaining-tokens"] = str(max(decision.remaining_tokens, 0))
    return headers


def bound_project(project: str | None, api_key: str | None, config: ServerConfig) -> str | None:
    """The project a request counts against, checked against the key's bindings (``api_key_projects``).

    With bindings configured, a key may name only its own projects (any other is a 403) and one that
    names none counts against its first; a key without bindings may name none."""
    if project is not None and (not project or len(project) > MAX_PROJECT_ID_CHARS or not project.isprintable()):
        raise InvalidRequest(f"ai_project_id must be 1 to {MAX_PROJECT_ID_CHARS} printable characters",
                             param="ai_project_id")
    bindings = config.api_key_projects
    if not bindings:
        return project
    allowed = bindings.get(api_key or "", [])
    if project is None:
        return allowed[0] if allowed else None
    if project not in allowed:
        raise PermissionDenied(f"this API key may not use project {project!r}", param="ai_project_id",
                               code="project_not_allowed")
    return project


async def decide_tier(requested: str | None, project: str | None, api_key: str | None, config: ServerConfig,
                      store: QuotaStore, flex_waiting: int, max_flex_waiting: int) -> TierDecision:
    from trtserver.plugins import await_me_maybe

    project = bound_project(project, api_key, config)
    tier = requested or "auto"
    if tier == "over-limit":
        raise InvalidRequest("service_tier \"over-limit\" is assigned by the server and cannot be requested",
                             param="service_tier")
    if tier == "no-limit":
        if api_key is None or api_key not in config.no_limit_api_keys:
            raise PermissionDenied("service_tier \"no-limit\" is not enabled for this API key",
                                   param="service_tier", code="tier_not_allowed")
        return TierDecision("no-limit", Priority.HIGH, project, False, {})
    if tier == "flex":
        if flex_waiting >= max_flex_waiting:
            raise RateLimited("the flex queue is full; retry later or use another service_tier",
                              param="service_tier", headers={"Retry-After": "5"})
        return TierDecision("flex", Priority.LOWEST, project, False, {})
    key = project or "default"
    limits = limits_for(config, key)
    if limits is None:
        return TierDecision(tier, Priority.NORMAL, project, False, {})
    now = time.monotonic()
    decision = await await_me_maybe(store.acquire(key, limits, now))
    if not isinstance(decision, QuotaDecision):
        raise TypeError("QuotaStore.acquire must return a QuotaDecision")
    headers = quota_headers(decision)
    if decision.allowed:
        counted = _counted.get()
        if counted is not None:
            counted.append((store, key, now))
        return TierDecision(tier, Priority.NORMAL, project, True, headers)
    if tier == "auto":
        return TierDecision("over-limit", Priority.LOW, project, False, headers)
    raise RateLimited(f"project {key!r} is over its quota", param=None,
                      headers={**headers, "Retry-After": str(math.ceil(decision.retry_after_s))})
