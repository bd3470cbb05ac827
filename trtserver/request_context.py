"""What plugins learn about a request besides its body."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trtserver.config import ServerConfig


@dataclass(slots=True)
class RequestContext:
    """One request's id, HTTP facts and scratch space shared by the hooks of that request.

    ``extra`` holds body fields trtserver does not know (plugins define their own request
    fields this way, e.g. ``stop_regex``); ``state`` is free for plugins to share data between
    their hooks for this request.
    """

    request_id: str
    config: ServerConfig
    model: str | None = None  # the served model's name (the request's ``model`` may be omitted)
    headers: Mapping[str, str] = field(default_factory=dict)
    query: Mapping[str, str] = field(default_factory=dict)
    api_key: str | None = None
    user: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    service_tier: str | None = None
    project: str | None = None
    # headers added to the HTTP response (rate-limit counters); plugins may add their own
    response_headers: dict[str, str] = field(default_factory=dict)
