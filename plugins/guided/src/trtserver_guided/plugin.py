"""The trtserver plugin: registers its four backends through ``trtserver_register_guided_backends``.

Backend names (what ``guided_decoding_backend`` / ``structured_outputs.backend`` may say):
``xgrammar`` (default), ``llguidance`` (alias ``guidance``), ``outlines``,
``lm-format-enforcer`` (aliases ``lmfe``, ``lm_format_enforcer``), and ``auto`` (xgrammar,
falling back to llguidance when xgrammar is missing or cannot do the spec). A backend is
registered only when its library is installed; none is imported before its first compile.

When the server shuts down, every compile still running ends at once: its callers get a 503 and
the compile worker processes are killed, so a slow compile never holds up the exit.
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from trtserver.errors import InvalidRequest, Overloaded
from trtserver.hookspecs import hookimpl
from trtserver.plugins import guided_backend_key

from trtserver_guided import worker

if TYPE_CHECKING:
    from aiohttp import web
    from trtserver.config import ServerConfig
    from trtserver.engine.base import GuidedBackend, GuidedDecoder
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
LIBRARIES = {  # the import name of each backend's library
    "xgrammar": "xgrammar",
    "llguidance": "llguidance",
    "outlines": "outlines_core",
    "lm-format-enforcer": "lmformatenforcer",
}
AUTO_ORDER = ("xgrammar", "llguidance")

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


def installed(canonical: str) -> bool:
    """Whether the backend's library can be imported (found, not imported)."""
    return importlib.util.find_spec(LIBRARIES[canonical]) is not None


def compile_guide(canonical: str, spec: GuideSpec, context: GuideContext) -> GuidedDecoder:
    """The decoder of one backend for ``spec`` (cached by the backend)."""
    return get_backend(canonical).decoder(spec, context)


def compile_auto(order: tuple[str, ...], spec: GuideSpec, context: GuideContext) -> GuidedDecoder:
    """The first backend of ``order`` that can do ``spec``; the first one's error when none can."""
    first: InvalidRequest | None = None
    for canonical in order:
        try:
            return compile_guide(canonical, spec, context)
        except InvalidRequest as exc:
            first = first or exc
    assert first is not None, "auto is registered only with a backend to try"
    raise first


def backends() -> dict[str, GuidedBackend]:
    """Every name this plugin registers, with its factory: the installed backends and their aliases,
    and ``auto`` when xgrammar or llguidance is installed."""
    available = {canonical for canonical in LIBRARIES if installed(canonical)}
    found: dict[str, GuidedBackend] = {name: functools.partial(compile_guide, canonical)
                                       for name, canonical in ALIASES.items() if canonical in available}
    order = tuple(canonical for canonical in AUTO_ORDER if canonical in available)
    if order:
        found["auto"] = functools.partial(compile_auto, order)
    return found


def guided_decoder(spec: GuideSpec, backend: str, context: GuideContext) -> GuidedDecoder:
    """What the backend this plugin registers as ``backend`` compiles for ``spec``, as the server
    gets it; ``KeyError`` when this plugin registers no such name (not installed, or unknown)."""
    return backends()[guided_backend_key(backend)](spec, context)


@hookimpl
def trtserver_register_guided_backends(register: Callable[[str, GuidedBackend], None]) -> None:
    for name, factory in backends().items():
        register(name, factory)


def stop_compiles() -> None:
    """End every pending compile of every backend: callers get a 503 now, worker processes die."""
    with _lock:
        running = list(_backends.values())
    for backend in running:
        backend.cache.fail_pending(Overloaded("the server is shutting down"))
    worker.kill_all()


async def _stop_compiles(app: web.Application) -> None:
    stop_compiles()


@hookimpl
def trtserver_app_created(app: web.Application, config: ServerConfig) -> None:
    app.on_shutdown.append(_stop_compiles)
