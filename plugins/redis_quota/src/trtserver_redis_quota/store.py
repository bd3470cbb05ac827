"""``RedisQuotaStore``: the in-memory store's sliding minute, held in Redis for every replica.

Per project, three keys under one hash tag: ``<prefix>{<project>}:requests`` (a sorted set of
admitted requests, scored by time), ``...:tokens`` (a sorted set of charges, members
``<id>:<tokens>``) and ``...:token_sum`` (their total). Each check and each charge is one Lua
script, so concurrent replicas cannot both take the last request of a minute. Time is Redis's own
clock (``TIME``): the replicas' clocks never meet.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import redis.asyncio as aioredis
import structlog
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from trtserver.config import TierLimits
from trtserver.errors import Overloaded
from trtserver.quota import WINDOW_S, QuotaDecision
from trtserver_redis_quota.settings import RedisQuotaSettings

WINDOW_US = int(WINDOW_S * 1_000_000)
KEY_TTL_MS = int(WINDOW_S * 1000) + 1000
NO_LIMIT = -1
LOG_INTERVAL_S = 60.0
# after a timeout (Redis hung, not refusing), requests skip it this long instead of each waiting out the timeout
HUNG_BACKOFF_S = 1.0
UNAVAILABLE = (RedisError, OSError, asyncio.TimeoutError)

# KEYS: requests, tokens, token_sum. ARGV: window (us), requests/min, tokens/min (-1: none), member, key ttl (ms).
# Returns {allowed, requests in window, tokens in window, oldest entry (us, -1: none), now (us)}.
ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cutoff = now - tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', cutoff)
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', cutoff)
if #expired > 0 then
  local gone = 0
  for i = 1, #expired do gone = gone + tonumber(string.match(expired[i], ':(%d+)$')) end
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', cutoff)
  if redis.call('ZCARD', KEYS[2]) == 0 then
    redis.call('DEL', KEYS[3])
  else
    redis.call('DECRBY', KEYS[3], gone)
  end
end
local requests = redis.call('ZCARD', KEYS[1])
local tokens = tonumber(redis.call('GET', KEYS[3]) or '0')
local oldest = -1
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if #first > 0 then oldest = tonumber(first[2]) end
first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if #first > 0 and (oldest < 0 or tonumber(first[2]) < oldest) then oldest = tonumber(first[2]) end
local rpm, tpm = tonumber(ARGV[2]), tonumber(ARGV[3])
local allowed = 0
if (rpm < 0 or requests < rpm) and (tpm < 0 or tokens < tpm) then
  allowed = 1
  redis.call('ZADD', KEYS[1], now, ARGV[4])
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
end
return {allowed, requests, tokens, oldest, now}
"""

# KEYS: tokens, token_sum. ARGV: member id, tokens, key ttl (ms).
CHARGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
redis.call('ZADD', KEYS[1], now, ARGV[1] .. ':' .. ARGV[2])
redis.call('INCRBY', KEYS[2], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
"""


def decision_from_counts(limits: TierLimits, allowed: bool, requests: int, tokens: int,
                         oldest_us: int, now_us: int) -> QuotaDecision:
    """The same decision ``MemoryQuotaStore.acquire`` makes from the same counts."""
    rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
    left_requests = None if rpm is None else rpm - requests
    left_tokens = None if tpm is None else tpm - tokens
    if not allowed:
        oldest = now_us if oldest_us < 0 else oldest_us
        return QuotaDecision(False, max(left_requests or 0, 0), max(left_tokens or 0, 0),
                             retry_after_s=max((oldest + WINDOW_US - now_us) / 1_000_000, 1.0))
    return QuotaDecision(True, None if left_requests is None else left_requests - 1, left_tokens)


def _log() -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger("trtserver.redis_quota")  # not cached here: logging may be configured later


class Outage:
    """Logs Redis being unreachable at most once a minute, and its return once."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.failures = 0
        self._logged_at: float | None = None
        self.skip_until = 0.0

    def failed(self, operation: str, exc: BaseException) -> None:
        now = time.monotonic()
        self.failures += 1
        if isinstance(exc, asyncio.TimeoutError):
            self.skip_until = now + HUNG_BACKOFF_S
        if self._logged_at is None or now - self._logged_at >= LOG_INTERVAL_S:
            _log().warning("quota_store_unavailable", operation=operation, error=f"{type(exc).__name__}: {exc}",
                           behaviour=self.behaviour, failures=self.failures)
            self._logged_at = now

    def succeeded(self) -> None:
        if self.failures:
            _log().info("quota_store_recovered", failures=self.failures)
            self.failures, self._logged_at, self.skip_until = 0, None, 0.0

    def skipping(self) -> bool:
        return time.monotonic() < self.skip_until


class RedisQuotaStore:
    """A ``trtserver.quota.QuotaStore``; the ``now`` its methods get is ignored for Redis's clock."""

    def __init__(self, settings: RedisQuotaSettings) -> None:
        self.settings = settings
        self.client = aioredis.Redis.from_url(
            settings.url, socket_timeout=settings.timeout_s, socket_connect_timeout=settings.timeout_s,
            # one immediate retry: a pooled connection that a Redis restart closed is reopened at once
            retry=Retry(NoBackoff(), 1))
        self._acquire = self.client.register_script(ACQUIRE)
        self._charge = self.client.register_script(CHARGE)
        self.outage = Outage(settings.on_unavailable)

    def keys(self, project: str) -> tuple[str, str, str]:
        base = f"{self.settings.key_prefix}{{{project}}}"
        return f"{base}:requests", f"{base}:tokens", f"{base}:token_sum"

    async def acquire(self, project: str, limits: TierLimits, now: float) -> QuotaDecision:
        rpm = NO_LIMIT if limits.requests_per_minute is None else limits.requests_per_minute
        tpm = NO_LIMIT if limits.tokens_per_minute is None else limits.tokens_per_minute
        try:
            if self.outage.skipping():
                raise asyncio.TimeoutError(f"no answer within {self.settings.timeout_s} s a moment ago")
            async with asyncio.timeout(self.settings.timeout_s):  # no task per call, as wait_for makes
                allowed, requests, tokens, oldest, now_us = await self._acquire(
                    keys=self.keys(project), args=[WINDOW_US, rpm, tpm, uuid.uuid4().hex, KEY_TTL_MS])
        except UNAVAILABLE as exc:
            self.outage.failed("acquire", exc)
            if self.settings.on_unavailable == "fail_closed":
                raise Overloaded("the quota store is unavailable; retry shortly", code="quota_store_unavailable",
                                 headers={"Retry-After": "1"}) from None
            return QuotaDecision(True, None, None)
        self.outage.succeeded()
        return decision_from_counts(limits, bool(allowed), int(requests), int(tokens), int(oldest), int(now_us))

    async def add_tokens(self, project: str, tokens: int, now: float) -> None:
        """Charged once the request has ended; a charge Redis cannot take is logged and dropped."""
        requests_key, tokens_key, sum_key = self.keys(project)
        try:
            if self.outage.skipping():
                raise asyncio.TimeoutError(f"no answer within {self.settings.timeout_s} s a moment ago")
            async with asyncio.timeout(self.settings.timeout_s):
                await self._charge(keys=[tokens_key, sum_key], args=[uuid.uuid4().hex, int(tokens), KEY_TTL_MS])
        except UNAVAILABLE as exc:
            self.outage.failed("add_tokens", exc)
            return
        self.outage.succeeded()

    async def aclose(self) -> None:
        await self.client.aclose()
