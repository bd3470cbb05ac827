"""The trtserver plugin: answers ``trtserver_guided_decoder`` for its four backends.

Backend names (what ``guided_decoding_backend`` / ``structured_outputs.backend`` may say):
``xgrammar`` (default), ``llguidance`` (alias ``guidance``), ``outlines``,
``lm-format-enforcer`` (aliases ``lmfe``, ``lm_format_enforcer``), and ``auto`` (xgrammar,
falling back to llguidance when xgrammar is missing or cannot do the spec). Any other name is
left to other plugins (None).

When the server shuts down, every compile still running ends at once: its callers get a 503 and
the compile worker processes are killed, so a slow compile never holds up the exit.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from trtserver.errors import InvalidRequest, Overloaded
from trtserver.hookspecs import hookimpl

from trtserver_guided import worker

if TYPE_CHECKING:
    from aiohttp import web
    from trtserver.config import ServerConfig
    from trtserver.engine.base import GuidedDecoder
    from trtserver.guided import GuideContext, GuideSpec

    from trtserver_guided.backend import Backend

ALIASES = {
    "xgrammar": "xgrammar",
    "llguidance": "llguidance",
    "guidance": "llguidance",
    "outlines": "outlines",
    "lm-format-enforcer": "lm-format-enforcer",
    "lm_format_enforcer": "lm-format-enforcer",
    "lmfe": "lm-format-enforcer",
}

_backends: dict[str, Backend] = {}
_lock = threading.Lock()


def get_backend(name: str) -> Backend:
    """The singleton backend object for a canonical name (created lazily; no library import)."""
    with _lock:
        backend = _backends.get(name)
        if backend is None:
            if name == "xgrammar":
                from trtserver_guided.backends.xgrammar import XGrammarBackend as cls
            elif name == "llguidance":
                from trtserver_guided.backends.llguidance import LLGuidanceBackend as cls  # type: ignore[assignment]
            elif name == "outlines":
                from trtserver_guided.backends.outlines import OutlinesBackend as cls  # type: ignore[assignment]
            else:
                from trtserver_guided.backends.lmfe import LMFEBackend as cls  # type: ignore[assignment]
            backend = _backends[name] = cls()
        return backend


def guided_decoder(spec: GuideSpec, backend: str, context: GuideContext) -> GuidedDecoder | None:
    name = backend.strip().lower()
    if name == "auto":
        try:
            return get_backend("xgrammar").decoder(spec, context)
        except InvalidRequest as first:
            try:
                return get_backend("llguidance").decoder(spec, context)
            except InvalidRequest:
                raise first from None
    canonical = ALIASES.get(name)
    if canonical is None:
        return None
    return get_backend(canonical).decoder(spec, context)


@hookimpl
def trtserver_guided_decoder(spec: GuideSpec, backend: str, context: GuideContext) -> GuidedDecoder | None:
    return guided_decoder(spec, backend, context)


def stop_compiles() -> None:
    """End every pending compile of every backend: callers get a 503 now, worker processes die."""
    with _lock:
        backends = list(_backends.values())
    for backend in backends:
        backend.cache.fail_pending(Overloaded("the server is shutting down"))
    worker.kill_all()


async def _stop_compiles(app: web.Application) -> None:
    stop_compiles()


@hookimpl
def trtserver_app_created(app: web.Application, config: ServerConfig) -> None:
    app.on_shutdown.append(_stop_compiles)
