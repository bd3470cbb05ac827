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
from dataclasses import dataclass
from typing import Protocol

from trtserver.config import ServerConfig, TierLimits
from trtserver.engine.base import Priority
from trtserver.errors import InvalidRequest, PermissionDenied, RateLimited
from trtserver.hookspecs import hookimpl

WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class QuotaDecision:
    allowed: bool
    remaining_requests: int | None
    remaining_tokens: int | None
    retry_after_s: float = 0.0


class QuotaStore(Protocol):
    """Counts per project over a sliding minute. Methods may be async (return awaitables)."""

    def acquire(self, project: str, limits: TierLimits, now: float) -> QuotaDecision | Awaitable[QuotaDecision]:
        """Decide whether one more request fits; count it when it does."""

    def add_tokens(self, project: str, tokens: int, now: float) -> Awaitable[None] | None:
        """Charge tokens used by a finished request."""


class MemoryQuotaStore:
    """One process's counts; replicas each keep their own (use a shared store to pool them)."""

    def __init__(self) -> None:
        self._requests: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)
        self._tokens: dict[str, collections.deque[tuple[float, int]]] = collections.defaultdict(collections.deque)

    def _trim(self, project: str, now: float) -> tuple[collections.deque[float], collections.deque[tuple[float, int]]]:
        requests, tokens = self._requests[project], self._tokens[project]
        while requests and requests[0] <= now - WINDOW_S:
            requests.popleft()
        while tokens and tokens[0][0] <= now - WINDOW_S:
            tokens.popleft()
        return requests, tokens

    def acquire(self, project: str, limits: TierLimits, now: float) -> QuotaDecision:
        requests, tokens = self._trim(project, now)
        used_tokens = sum(n for _, n in tokens)
        left_requests = None if limits.requests_per_minute is None else limits.requests_per_minute - len(requests)
        left_tokens = None if limits.tokens_per_minute is None else limits.tokens_per_minute - used_tokens
        if (left_requests is not None and left_requests <= 0) or (left_tokens is not None and left_tokens <= 0):
            firsts = ([requests[0]] if requests else []) + ([tokens[0][0]] if tokens else [])
            oldest = min(firsts, default=now)
            return QuotaDecision(False, max(left_requests or 0, 0), max(left_tokens or 0, 0),
                                 retry_after_s=max(oldest + WINDOW_S - now, 1.0))
        requests.append(now)
        return QuotaDecision(True, None if left_requests is None else left_requests - 1, left_tokens)

    def add_tokens(self, project: str, tokens: int, now: float) -> None:
        self._tokens[project].append((now, tokens))


@hookimpl(trylast=True)
def trtserver_quota_store(config: ServerConfig) -> QuotaStore:
    return MemoryQuotaStore()


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


async def decide_tier(requested: str | None, project: str | None, api_key: str | None, config: ServerConfig,
                      store: QuotaStore, flex_waiting: int, max_flex_waiting: int) -> TierDecision:
    from trtserver.plugins import await_me_maybe

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
    decision = await await_me_maybe(store.acquire(key, limits, time.monotonic()))
    if not isinstance(decision, QuotaDecision):
        raise TypeError("QuotaStore.acquire must return a QuotaDecision")
    headers = quota_headers(decision)
    if decision.allowed:
        return TierDecision(tier, Priority.NORMAL, project, True, headers)
    if tier == "auto":
        return TierDecision("over-limit", Priority.LOW, project, False, headers)
    raise RateLimited(f"project {key!r} is over its quota", param=None,
                      headers={**headers, "Retry-After": str(math.ceil(decision.retry_after_s))})
