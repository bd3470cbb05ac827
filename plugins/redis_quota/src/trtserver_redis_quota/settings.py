"""The ``[plugins.redis_quota]`` table."""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta

SCHEMES = ("redis", "rediss", "unix")


class RedisQuotaSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``url``: ``redis://[:password@]host:port/db``, ``rediss://`` for TLS (``?ssl_ca_certs=/path``),
    or ``unix:///path``. ``key_prefix`` keeps deployments that share one Redis apart.
    ``on_unavailable``: when Redis cannot answer within ``timeout_s``, ``fail_open`` serves the
    request uncounted (logged once a minute); ``fail_closed`` refuses it with 503 and Retry-After."""

    url: str
    key_prefix: str = "trtserver:quota:"
    on_unavailable: Literal["fail_open", "fail_closed"] = "fail_open"
    timeout_s: Annotated[float, Meta(gt=0, le=30)] = 1.0

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in SCHEMES:
            raise ValueError(f"url must start with one of {', '.join(s + '://' for s in SCHEMES)}; got {scheme!r}")
