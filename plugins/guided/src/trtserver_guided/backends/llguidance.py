"""llguidance backend: JSON schema, json_object, regex, choice, Lark and GBNF grammars.

The ``LLTokenizer`` is built straight from the model's ``tokenizer.json`` (llguidance's Rust
side reads it with the same tokenizers library, byte-exact, special tokens excluded), so
``transformers`` is not needed. ``whitespace_pattern`` and ``disable_any_whitespace`` map to
llguidance's ``whitespace_pattern`` / ``whitespace_flexible=False`` JSON options. llguidance
follows JSON Schema literally: a missing ``additionalProperties`` allows extra properties.

Limits. llguidance bounds its own work (``LLParserLimits``: lexer fuel, Earley items per row,
grammar size) and, past a limit, puts the matcher in an error state rather than raising: a
``guided_choice`` of 10,000 strings as one grammar rule exceeds the 2,000 items an Earley row may
hold on the first token, and ``a{1000000}`` makes its lexer build too many derivative expressions.
So a choice is one lexer terminal (an alternation the lexer matches, not 10,000 grammar rows), and
each compile takes a first step on a copy (mask, one allowed token, mask): a guide that fails
there is a 400 with llguidance's reason. A matcher that enters the error state later allows no
token (an all-zero mask row) and refuses every token, so the engine ends that sequence with an
error; it never reports such a state as the guide's end.
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
        if self._m.is_error():
            self._failed = True
            buf[:] = 0

    def _advance(self, token_id: int) -> bool:
        return bool(self._m.consume_token(token_id)) and not self._m.is_error()

    def _can_stop(self) -> bool:
        if self._m.is_error():
            return False
        return bool(self._m.is_accepting()) or bool(self._m.is_stopped())

    def _accept_stop(self, token_id: int) -> bool:
        return self._can_stop()

    def is_terminated(self) -> bool:
        if self._m.is_error():
            self._failed = True
            return False
        if not self._stopped and not self._failed and self._m.is_stopped():
            return True
        return super().is_terminated()

    @property
    def error(self) -> str:
        """llguidance's reason when the matcher is in its error state, else ''."""
        return str(self._m.get_error()) if self._m.is_error() else ""


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
                grammar = llguidance.grammar_from("lark", choice_lark(spec.value))
            else:
                text = str(spec.value)
                grammar = llguidance.grammar_from("grammar" if "::=" in text else "lark", text)
        except Exception as exc:
            raise InvalidRequest(f"llguidance cannot compile this {spec.kind} guide: {exc}") from exc
        proto = self.lanes.run_here(lambda: self._matcher(grammar, lltok, spec), timeout)
        decoder = LLGuidanceDecoder(proto, vocab, stop_words, not_stop)
        first_step(decoder, spec)
        return decoder

    @staticmethod
    def _matcher(grammar: str, lltok: Any, spec: GuideSpec) -> Any:
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, lltok)
        if error and not error.startswith("WARNING"):
            raise InvalidRequest(f"llguidance cannot compile this {spec.kind} guide: {error}")
        proto = llguidance.LLMatcher(lltok, grammar, log_level=0)
        if proto.is_error():
            raise InvalidRequest(f"llguidance cannot compile this {spec.kind} guide: {proto.get_error()}")
        return proto


def choice_lark(choices: tuple[str, ...] | str) -> str:
    items = [choices] if isinstance(choices, str) else list(choices)
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in items)


def first_step(decoder: LLGuidanceDecoder, spec: GuideSpec) -> None:
    """Mask, take one allowed token, mask again, on a fresh state: refuse what fails already."""
    state = decoder.new_state()
    assert isinstance(state, LLGuidanceState)
    allowed = state.allowed_token_ids()
    if not state.error and allowed and not state.is_terminated():
        stops = set(decoder._vocab.eos_token_ids)
        token = next((t for t in allowed if t not in stops), None)
        if token is not None and state.accept_token(token):
            state.allowed_token_ids()
    if state.error:
        raise InvalidRequest(f"llguidance cannot follow this {spec.kind} guide: {state.error.splitlines()[0]}")
