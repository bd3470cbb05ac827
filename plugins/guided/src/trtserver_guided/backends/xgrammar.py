"""xgrammar backend (the default): JSON schema, json_object, regex, choice, EBNF/GBNF and Lark.

The tokenizer info is built from the byte-exact vocabulary with special tokens set to ``b""``
(xgrammar treats empty tokens as special, so they are never allowed) and the served model's
EOS ids as stop tokens. xgrammar has no whitespace regex: ``whitespace_pattern`` is refused
with a 400 naming the backends that have one; ``disable_any_whitespace`` maps to
``any_whitespace=False``. xgrammar's own compile cache is disabled (ours bounds the entries).
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


class XGrammarState(MaskState):
    __slots__ = ("_m", "_row")

    def __init__(self, matcher: Any, vocab: Vocab, stop_words: np.ndarray, not_stop: np.ndarray) -> None:
        super().__init__(vocab, stop_words, not_stop)
        self._m = matcher
        self._row = self._tbuf.view(1, -1)

    def _compute(self, buf: np.ndarray) -> None:
        self._m.fill_next_token_bitmask(self._row, 0)

    def _advance(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))

    def _can_stop(self) -> bool:
        # xgrammar allows the stop tokens in its mask exactly when the grammar may end
        return bool(self._m.is_completed()) if hasattr(self._m, "is_completed") else True

    def _accept_stop(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))


class XGrammarDecoder:
    def __init__(self, compiled: Any, vocab: Vocab, stop_words: np.ndarray, not_stop: np.ndarray) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.compiled = compiled
        self._vocab, self._stop_words, self._not_stop = vocab, stop_words, not_stop

    def new_state(self) -> TokenConstraint:
        matcher = self._xgr.GrammarMatcher(self.compiled)
        return XGrammarState(matcher, self._vocab, self._stop_words, self._not_stop)


def choice_grammar(choices: tuple[str, ...] | str) -> str:
    items = [choices] if isinstance(choices, str) else list(choices)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in items)


class XGrammarBackend(Backend):
    name = "xgrammar"
    extra = "xgrammar"
    module = "xgrammar"

    def check(self, spec: GuideSpec) -> None:
        super().check(spec)
        if spec.whitespace_pattern and spec.kind in ("json", "json_object"):
            raise InvalidRequest(
                "guided decoding backend 'xgrammar' cannot honour whitespace_pattern; "
                "use backend 'llguidance' or 'outlines', or disable_any_whitespace")

    def _load(self, vocab: Vocab) -> Any:
        import xgrammar as xgr

        encoded = [b if b is not None else b"" for b in vocab.token_bytes]
        info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab.vocab_size,
                                 stop_token_ids=list(vocab.eos_token_ids), add_prefix_space=False)
        return xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def _compile(self, spec: GuideSpec, data: tuple[Vocab, Any, np.ndarray, np.ndarray],
                 timeout: float) -> XGrammarDecoder:
        vocab, compiler, stop_words, not_stop = data
        any_ws = not spec.disable_any_whitespace
        try:
            if spec.kind == "json":
                compiled = compiler.compile_json_schema(str(spec.value), any_whitespace=any_ws, strict_mode=True)
            elif spec.kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_ws,
                                                        strict_mode=False)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(str(spec.value))
            elif spec.kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(spec.value))
            else:
                text = str(spec.value)
                if "::=" in text or not hasattr(compiler, "compile_lark"):
                    compiled = compiler.compile_grammar(text)
                else:
                    compiled = compiler.compile_lark(text)
        except Exception as exc:  # the library's parse / compile errors
            raise InvalidRequest(f"xgrammar cannot compile this {spec.kind} guide: {exc}") from exc
        return XGrammarDecoder(compiled, vocab, stop_words, not_stop)
