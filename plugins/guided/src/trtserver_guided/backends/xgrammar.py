"""xgrammar backend (the default): JSON schema, json_object, regex, choice, EBNF/GBNF and Lark.

The tokenizer info is built from the byte-exact vocabulary with special tokens set to ``b""``
(xgrammar treats empty tokens as special, so they are never allowed) and the served model's
EOS ids as stop tokens. xgrammar has no whitespace regex: ``whitespace_pattern`` is refused
with a 400 naming the backends that have one; ``disable_any_whitespace`` maps to
``any_whitespace=False``. xgrammar's own compile cache is disabled (ours bounds the entries).

Bounds. xgrammar compiles in C++ (the GIL released) and cannot be interrupted, and a compile in a
subprocess would cost more than the compile itself (importing xgrammar takes seconds, and
shipping a large compiled grammar back costs more than compiling it). What makes its compiles
long is refused up front instead: a guide whose text exceeds ``MAX_GUIDE_BYTES``
(``TRTSERVER_GUIDED_XGRAMMAR_MAX_KB``, default 512 KiB), or whose counted repetitions unroll to
more than ``MAX_REPEAT_WEIGHT`` (``TRTSERVER_GUIDED_XGRAMMAR_MAX_REPEAT``, default 4096) atoms
(see ``limits.py``): ``[^x]{1,100000}`` or ``(.{1,1000}){1,1000}`` would take minutes.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import numpy as np
from trtserver.errors import InvalidRequest

from trtserver_guided.backend import Backend
from trtserver_guided.limits import grammar_weight, regex_weight, schema_patterns
from trtserver_guided.state import MaskState

if TYPE_CHECKING:
    from trtserver.engine.base import GuidedDecoder, TokenConstraint
    from trtserver.guided import GuideSpec

    from trtserver_guided.vocab import Vocab

MAX_GUIDE_BYTES = int(os.environ.get("TRTSERVER_GUIDED_XGRAMMAR_MAX_KB", "512")) << 10
MAX_REPEAT_WEIGHT = int(os.environ.get("TRTSERVER_GUIDED_XGRAMMAR_MAX_REPEAT", "4096"))


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
        size = sum(len(c.encode()) for c in spec.value) if isinstance(spec.value, tuple) \
            else len(spec.value.encode())
        if size > MAX_GUIDE_BYTES:
            raise InvalidRequest(f"guided decoding backend 'xgrammar' compiles guides of at most "
                                 f"{MAX_GUIDE_BYTES >> 10} KiB; this one has {size >> 10} KiB")
        weight = self._repeat_weight(spec)
        if weight > MAX_REPEAT_WEIGHT:
            raise InvalidRequest(f"guided decoding backend 'xgrammar' refuses this {spec.kind} guide: its counted "
                                 f"repetitions ({{m,n}}) unroll to about {weight} items, more than "
                                 f"{MAX_REPEAT_WEIGHT}")

    @staticmethod
    def _repeat_weight(spec: GuideSpec) -> int:
        if spec.kind == "regex":
            return regex_weight(str(spec.value))
        if spec.kind == "grammar":
            return grammar_weight(str(spec.value))
        if spec.kind == "json":
            try:
                schema = json.loads(str(spec.value))
            except ValueError:
                return 0  # the compiler reports it
            return max((regex_weight(p) for p in schema_patterns(schema)), default=0)
        return 0

    def footprint(self, decoder: GuidedDecoder) -> int:
        return int(decoder.compiled.memory_size_bytes) if isinstance(decoder, XGrammarDecoder) else 0

    def _load(self, vocab: Vocab) -> Any:
        import xgrammar as xgr

        encoded = [b if b is not None else b"" for b in vocab.token_bytes]
        info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab.vocab_size,
                                 stop_token_ids=list(vocab.eos_token_ids), add_prefix_space=False)
        return xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def _compile(self, spec: GuideSpec, data: tuple[Vocab, Any, np.ndarray, np.ndarray],
                 timeout: float) -> XGrammarDecoder:
        vocab, compiler, stop_words, not_stop = data
        compiled = self.lanes.run_here(lambda: self._build(spec, compiler), timeout)
        return XGrammarDecoder(compiled, vocab, stop_words, not_stop)

    @staticmethod
    def _build(spec: GuideSpec, compiler: Any) -> Any:
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
        return compiled
