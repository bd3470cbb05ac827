"""lm-format-enforcer backend: JSON schema, json_object, regex and choice (no grammars).

The tokenizer data is built from the byte-exact vocabulary directly (LMFE's transformers
integration is not used: it fails to import on transformers 5). LMFE works on text, so tokens
that are not whole UTF-8 sequences are left out of its alphabet rather than shown to it as
U+FFFD: characters that only byte-piece tokens can spell cannot be produced by this backend.
LMFE is character-level and pure Python; its allowed-token lists are turned into the bitmask
with numpy. ``whitespace_pattern`` is refused (400); ``disable_any_whitespace`` sets LMFE's
``max_consecutive_whitespaces`` to 0.

Bounds. LMFE turns a regex (``guided_regex``, or a ``pattern`` in a JSON schema) into a DFA with
interegular, in pure Python and exponential in the worst case (``(a|b)*a(a|b){18}``; the plugin's
README has the figures). Those DFAs are therefore built in a killable subprocess
(``worker.run_in_worker``, limited to ``TRTSERVER_GUIDED_LMFE_MAX_MB``, default 2048 MiB) at
compile time, never lazily while decoding; the parsers are then built around them here.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import numpy as np
from trtserver.errors import InvalidRequest

from trtserver_guided.backend import Backend, strip_anchors
from trtserver_guided.limits import schema_patterns
from trtserver_guided.state import MaskState
from trtserver_guided.vocab import ids_to_words
from trtserver_guided.worker import run_in_worker

if TYPE_CHECKING:
    from collections.abc import Callable

    from trtserver.engine.base import TokenConstraint
    from trtserver.guided import GuideSpec

    from trtserver_guided.vocab import Vocab

MAX_MB = int(os.environ.get("TRTSERVER_GUIDED_LMFE_MAX_MB", "2048"))


def lmfe_patterns(schema: Any) -> set[str]:
    """The schema's ``pattern`` strings as LMFE keys its regex cache (no ``^`` / ``$``)."""
    found: set[str] = set()
    for value in schema_patterns(schema):
        pattern = value.removeprefix("^")
        found.add(pattern.removesuffix("$"))
    return found


def regex_parser(fsm: Any, alphabet: str) -> Any:
    """LMFE's RegexParser around a DFA built elsewhere."""
    from lmformatenforcer import CharacterLevelParserConfig, RegexParser

    context = RegexParser._Context()
    context.pattern = fsm
    context.state_character_cache = {}
    parser = RegexParser(context)
    parser.config = CharacterLevelParserConfig(alphabet=alphabet)  # sets the "any other character" set
    return parser


class LMFEState(MaskState):
    __slots__ = ("_enf", "_tokens")

    def __init__(self, enforcer: Any, vocab: Vocab, stop_words: np.ndarray, not_stop: np.ndarray) -> None:
        super().__init__(vocab, stop_words, not_stop)
        self._enf = enforcer
        self._tokens: list[int] = []
        
    def _allowed(self) -> Any:
        return self._enf.get_allowed_tokens(self._tokens)

    def _compute(self, buf: np.ndarray) -> None:
        buf[:] = ids_to_words(self._allowed().allowed_tokens, self._vocab.vocab_size)

    def _advance(self, token_id: int) -> bool:
        if not self._allowed().is_token_allowed(token_id):
            return False
        self._tokens.append(token_id)
        return True

    def _can_stop(self) -> bool:
        self._allowed()
        return bool(self._enf.prefix_states[tuple(self._tokens)].parser.can_end())


class LMFEDecoder:
    def __init__(self, make_parser: Callable[[], Any], tokdata: Any, vocab: Vocab, stop_words: np.ndarray,
                 not_stop: np.ndarray, max_whitespace: int | None) -> None:
        self._make_parser = make_parser
        self._max_whitespace = max_whitespace
        self._tokdata = tokdata
        self._vocab, self._stop_words, self._not_stop = vocab, stop_words, not_stop

    def new_state(self) -> TokenConstraint:
        from lmformatenforcer import TokenEnforcer

        # one enforcer per sequence: its prefix cache grows with the sequence and is never evicted
        parser = self._make_parser()
        enforcer = TokenEnforcer(self._tokdata, parser)  # replaces parser.config
        if self._max_whitespace is not None:
            parser.config.max_consecutive_whitespaces = self._max_whitespace
        return LMFEState(enforcer, self._vocab, self._stop_words, self._not_stop)


class LMFEBackend(Backend):
    name = "lm-format-enforcer"
    extra = "lmfe"
    module = "lmformatenforcer"
    kinds = frozenset({"json", "json_object", "regex", "choice"})

    def check(self, spec: GuideSpec) -> None:
        super().check(spec)
        if spec.whitespace_pattern:
            raise InvalidRequest("guided decoding backend 'lm-format-enforcer' cannot honour whitespace_pattern; "
                                 "use backend 'llguidance' or 'outlines'")

    def _load(self, vocab: Vocab) -> Any:
        from lmformatenforcer import TokenEnforcerTokenizerData

        regular: list[tuple[int, str, bool]] = []
        for tid, raw in enumerate(vocab.token_bytes):
            if raw is None:
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue  # a piece of a multi-byte character: LMFE cannot reason about it
            # byte-level tokens are self-contained text, so each one "starts a word" for LMFE
            regular.append((tid, text, True))
        strs = {tid: text for tid, text, _ in regular}

        def decode(ids: list[int]) -> str:
            return "".join(strs.get(i, "") for i in ids)

        return TokenEnforcerTokenizerData(regular, decode, list(vocab.eos_token_ids), False, vocab.vocab_size)

    def _compile(self, spec: GuideSpec, data: tuple[Vocab, Any, np.ndarray, np.ndarray],
                 timeout: float) -> LMFEDecoder:
        from lmformatenforcer import JsonSchemaParser, RegexParser, StringParser, UnionParser

        vocab, tokdata, stop_words, not_stop = data
        kind, value = spec.kind, spec.value
        try:
            schema = json.loads(str(value)) if kind == "json" else None  # dicts keep the client's key order
        except ValueError as exc:
            raise InvalidRequest(f"lm-format-enforcer cannot compile this {kind} guide: {exc}") from exc
        pattern = strip_anchors(str(value)) if kind == "regex" else None
        patterns = {pattern} if pattern is not None else lmfe_patterns(schema)
        fsms = run_in_worker("interegular", {"patterns": sorted(patterns)}, timeout, self.lanes, MAX_MB) \
            if patterns else {}
        alphabet = tokdata.tokenizer_alphabet
        if kind == "json":
            cache = JsonSchemaParser._Context.regex_parser_cache  # LMFE's own, process-wide
            for text, fsm in fsms.items():
                cache.setdefault(text, regex_parser(fsm, alphabet))
        try:
            if kind == "json":
                def make() -> Any:
                    return JsonSchemaParser(schema)
            elif kind == "json_object":
                def make() -> Any:
                    return JsonSchemaParser({"type": "object"})
            elif kind == "regex":
                shared = regex_parser(fsms[pattern], alphabet)

                def make() -> Any:
                    return RegexParser(shared.context)
            else:
                items = list(value) if isinstance(value, tuple) else [str(value)]

                def make() -> Any:
                    return UnionParser([StringParser(c) for c in items])
            make()  # validate now: a bad schema is the client's 400, not a broken stream
        except Exception as exc:
            raise InvalidRequest(f"lm-format-enforcer cannot compile this {kind} guide: {exc}") from exc
        return LMFEDecoder(make, tokdata, vocab, stop_words, not_stop, 0 if spec.disable_any_whitespace else None)
