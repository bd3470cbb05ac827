"""The built-in quota store: per-project counts in this process's memory, answering last."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trtserver.hookspecs import hookimpl
from trtserver.quota import MemoryQuotaStore, QuotaStore

if TYPE_CHECKING:
    from trtserver.config import ServerConfig


@hookimpl(trylast=True)
def trtserver_quota_store(config: ServerConfig) -> QuotaStore:
    return MemoryQuotaStore(max_projects=config.max_quota_projects)
