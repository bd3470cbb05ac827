"""llguidance backend: JSON schema, json_object, regex, choice, Lark and GBNF grammars.

The ``LLTokenizer`` is built straight from the model's ``tokenizer.json`` (llguidance's Rust
side reads it with the same tokenizers library, byte-exact, special tokens excluded), so
``transformers`` is not needed. ``whitespace_pattern`` and ``disable_any_whitespace`` map to
llguidance's ``whitespace_pattern`` / ``whitespace_flexible=False`` JSON options. llguidance
follows JSON Schema literally: a missing ``additionalProperties`` allows extra properties.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np
from trtserver.errors import InvalidRequest

from trtserver_guided.backend import Backend
from trtserver_guided.state import MaskState

if TYPE_CHECKING:
    from trtserver.engine.base import TokenConstraint
    from trtserver.guided import GuideSpec

    from trtserver_guided.vocab import Vocab


class LLGuidanceState(MaskState):
    __slots__ = ("_m", "_nbytes", "_ptr")

    def __init__(self, matcher: Any, vocab: Vocab, stop_words: np.ndarray, not_stop: np.ndarray) -> None:
        super().__init__(vocab, stop_words, not_stop)
        self._m = matcher
        self._ptr = self._buf.ctypes.data
        self._nbytes = self._buf.nbytes

    def _compute(self, buf: np.ndarray) -> None:
        self._m.unsafe_compute_mask_ptr(self._ptr, self._nbytes)

    def _advance(self, token_id: int) -> bool:
        return bool(self._m.consume_token(token_id)) and not self._m.is_error()

    def _can_stop(self) -> bool:
        return bool(self._m.is_accepting()) or bool(self._m.is_stopped())

    def _accept_stop(self, token_id: int) -> bool:
        return self._can_stop()

    def is_terminated(self) -> bool:
        if not self._stopped and not self._failed and self._m.is_stopped():
            return True
        return super().is_terminated()


class LLGuidanceDecoder:
    def __init__(self, proto: Any, vocab: Vocab, stop_words: np.ndarray, not_stop: np.ndarray) -> None:
        self._proto = proto
        self._vocab, self._stop_words, self._not_stop = vocab, stop_words, not_stop

    def new_state(self) -> TokenConstraint:
        return LLGuidanceState(self._proto.deep_copy(), self._vocab, self._stop_words, self._not_stop)


class LLGuidanceBackend(Backend):
    name = "llguidance"
    extra = "llguidance"
    module = "llguidance"

    def _load(self, vocab: Vocab) -> Any:
        import llguidance

        return llguidance.LLTokenizer(vocab.tokenizer_json, n_vocab=vocab.vocab_size,
                                      eos_token=list(vocab.eos_token_ids))

    def _compile(self, spec: GuideSpec, data: tuple[Vocab, Any, np.ndarray, np.ndarray],
                 timeout: float) -> LLGuidanceDecoder:
        import llguidance

        vocab, lltok, stop_words, not_stop = data
        options: dict[str, Any] = {}
        if spec.whitespace_pattern:
            options["whitespace_pattern"] = spec.whitespace_pattern
        elif spec.disable_any_whitespace:
            options["whitespace_flexible"] = False
        try:
            if spec.kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(str(spec.value), overrides=options or None)  # type: ignore[arg-type]
            elif spec.kind == "json_object":
                grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                                        overrides=options or None)  # type: ignore[arg-type]
            elif spec.kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(str(spec.value))
            elif spec.kind == "choice":
                items = list(spec.value) if isinstance(spec.value, tuple) else [spec.value]
                grammar = llguidance.grammar_from("choice", json.dumps(items))
            else:
                text = str(spec.value)
                grammar = llguidance.grammar_from("grammar" if "::=" in text else "lark", text)
        except Exception as exc:
            raise InvalidRequest(f"llguidance cannot compile this {spec.kind} guide: {exc}") from exc
        error = llguidance.LLMatcher.validate_grammar(grammar, lltok)
        if error and not error.startswith("WARNING"):
            raise InvalidRequest(f"llguidance cannot compile this {spec.kind} guide: {error}")
        proto = llguidance.LLMatcher(lltok, grammar, log_level=0)
        if proto.is_error():
            raise InvalidRequest(f"llguidance cannot compile this {spec.kind} guide: {proto.get_error()}")
        return LLGuidanceDecoder(proto, vocab, stop_words, not_stop)
