"""What each guided-decoding backend implements, and the shared compile cache in front of it."""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from trtserver.errors import InvalidRequest

from trtserver_guided import worker
from trtserver_guided.cache import CompileCache
from trtserver_guided.vocab import Vocab, vocab_for
from trtserver_guided.worker import Lanes

if TYPE_CHECKING:
    from trtserver.engine.base import GuidedDecoder, TokenConstraint
    from trtserver.guided import GuideContext, GuideSpec

INSTALL_HINT = "pip install 'trtserver-guided[{extra}]'"
# compiled guides kept per backend and process, by the bytes their library reports (their sizes vary widely)
CACHE_BYTES = int(os.environ.get("TRTSERVER_GUIDED_CACHE_MB", "256")) << 20


def strip_anchors(regex: str) -> str:
    """Drop one leading ``^`` / ``\\A`` and one trailing unescaped ``$`` / ``\\z`` (the guide always
    matches the whole output) for libraries whose regex dialect has no anchors."""
    for prefix in ("\\A", "^"):
        if regex.startswith(prefix):
            regex = regex[len(prefix):]
            break
    for suffix in ("\\z", "\\Z", "$"):
        if regex.endswith(suffix) and not regex.endswith("\\" + suffix):
            regex = regex[: -len(suffix)]
            break
    return regex


class Backend:
    """One per backend name. ``compile`` is called through the cache; subclasses implement
    ``_load`` (import the library, build the per-tokenizer data) and ``_compile``."""

    name: ClassVar[str]
    extra: ClassVar[str]
    module: ClassVar[str]  # the library's import name, for the not-installed check
    kinds: ClassVar[frozenset[str]] = frozenset({"json", "json_object", "regex", "choice", "grammar"})

    def __init__(self) -> None:
        self.cache: CompileCache[Portable] = CompileCache(max_bytes=CACHE_BYTES,
                                                          size=lambda guide: self.footprint(guide.decoder))
        self.lanes = Lanes(self.name)
        self._lock = threading.Lock()
        self._per_vocab: dict[int, tuple[Vocab, Any, np.ndarray, np.ndarray]] = {}

    def library(self) -> Any:
        try:
            return importlib.import_module(self.module)
        except ImportError as exc:
            raise InvalidRequest(
                f"guided decoding backend {self.name!r} is not installed ({exc}); "
                f"install it with: {INSTALL_HINT.format(extra=self.extra)}") from exc

    def check(self, spec: GuideSpec) -> None:
        """Refuse (400) what this backend cannot do, before compiling."""
        if spec.kind not in self.kinds:
            what = "grammars" if spec.kind == "grammar" else f"{spec.kind!r} guides"
            raise InvalidRequest(f"guided decoding backend {self.name!r} does not support {what}; "
                                 "use backend 'xgrammar' or 'llguidance'")

    def tokenizer_data(self, context: GuideContext) -> tuple[Vocab, Any, np.ndarray, np.ndarray]:
        """(vocab, backend-specific tokenizer data, stop words, alphabet-without-stop words)."""
        vocab = vocab_for(context)
        key = id(vocab)
        with self._lock:
            hit = self._per_vocab.get(key)
            if hit is None or hit[0] is not vocab:
                hit = (vocab, self._load(vocab), vocab.stop_mask(), vocab.allowed_alphabet_mask())
                self._per_vocab[key] = hit
            return hit

    def decoder(self, spec: GuideSpec, context: GuideContext) -> GuidedDecoder:
        self.check(spec)
        self.library()
        data = self.tokenizer_data(context)
        key = (self.name, id(data[0]), spec.cache_key)
        timeout = float(context.compile_timeout_s)
        asked = worker.kills()  # a shutdown from now on starts none of this compile's workers

        def compile_guide() -> Portable:
            return worker.within(asked, lambda: Portable(self._compile(spec, data, timeout), (self.name, spec, context)))

        return self.cache.get(key, compile_guide, timeout)

    # --- subclasses ---------------------------------------------------------------------------
    def footprint(self, decoder: GuidedDecoder) -> int:
        """Bytes a compiled guide holds, where the library says (bounds the cache); 0 = unknown."""
        return 0

    def _load(self, vocab: Vocab) -> Any:
        raise NotImplementedError

    def _compile(self, spec: GuideSpec, data: tuple[Vocab, Any, np.ndarray, np.ndarray],
                 timeout: float) -> GuidedDecoder:
        raise NotImplementedError


class Portable:
    """A compiled guide that crosses to the server's engine process as its recipe (backend name,
    spec, model context; a few hundred bytes, the tokenizer crossing as a reference) and is
    compiled again there, once per guide, into that process's compile cache. The libraries'
    compiled grammars do not pickle (xgrammar's), or carry the whole vocabulary (megabytes)."""

    __slots__ = ("decoder", "recipe")

    def __init__(self, decoder: GuidedDecoder, recipe: tuple[str, GuideSpec, GuideContext]) -> None:
        self.decoder = decoder
        self.recipe = recipe

    def new_state(self) -> TokenConstraint:
        return self.decoder.new_state()

    def __reduce__(self) -> tuple[Callable[..., GuidedDecoder], tuple[str, GuideSpec, GuideContext]]:
        return _recompile, self.recipe


def _recompile(backend: str, spec: GuideSpec, context: GuideContext) -> GuidedDecoder:
    from trtserver_guided.plugin import get_backend

    return get_backend(backend).decoder(spec, context)

