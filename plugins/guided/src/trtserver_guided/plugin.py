"""The trtserver plugin: answers ``trtserver_guided_decoder`` for its four backends.

Backend names (what ``guided_decoding_backend`` / ``structured_outputs.backend`` may say):
``xgrammar`` (default), ``llguidance`` (alias ``guidance``), ``outlines``,
``lm-format-enforcer`` (aliases ``lmfe``, ``lm_format_enforcer``), and ``auto`` (xgrammar,
falling back to llguidance when xgrammar is missing or cannot do the spec). Any other name is
left to other plugins (None).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from trtserver.errors import InvalidRequest
from trtserver.hookspecs import hookimpl

if TYPE_CHECKING:
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
