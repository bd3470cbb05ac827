"""outlines backend, on outlines-core's ``Index`` / ``Guide`` directly (not the outlines package).

JSON schema, json_object, regex and choice; grammars are refused with a 400 (outlines-core has
no CFG). ``whitespace_pattern`` is passed to ``build_regex_from_schema``; ``disable_any_whitespace``
means no whitespace at all between JSON tokens (the default is outlines' ``[ ]?``).

Bounds. Regex -> DFA -> token index construction is exponential in the worst case (a top-level
``{"type":"string","maxLength":20}``; the plugin's README has the figures). Every compile therefore runs in a
fresh subprocess (``worker.run_in_worker``) with ``RLIMIT_AS`` (``TRTSERVER_GUIDED_OUTLINES_MAX_MB``,
default 2048 MiB), inside the backend's compile lanes, and is killed at the request's
``compile_timeout_s``. The finished Index is pickled back.

Known upstream bug (outlines-core <= 0.2.14): a transition from an accepting state into a
non-accepting one is dropped, so ``1(\\.2)?`` cannot produce ``1.2`` and choice
``["yes", "yes please"]`` can only produce ``yes``. Fixed on outlines-core main (2ba0b24).
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Any

import numpy as np

from trtserver_guided.backend import Backend, strip_anchors
from trtserver_guided.state import MaskState
from trtserver_guided.worker import run_in_worker

if TYPE_CHECKING:
    from trtserver.engine.base import TokenConstraint
    from trtserver.guided import GuideSpec

    from trtserver_guided.vocab import Vocab

MAX_MB = int(os.environ.get("TRTSERVER_GUIDED_OUTLINES_MAX_MB", "2048"))


class OutlinesState(MaskState):
    __slots__ = ("_g", "_n", "_ptr")

    def __init__(self, guide: Any, vocab: Vocab, stop_words: np.ndarray, not_stop: np.ndarray) -> None:
        super().__init__(vocab, stop_words, not_stop)
        self._g = guide
        self._ptr = self._buf.ctypes.data
        self._n = self._buf.size

    def _compute(self, buf: np.ndarray) -> None:
        self._g.write_mask_into(self._ptr, self._n, 4)

    def _advance(self, token_id: int) -> bool:
        try:
            self._g.advance(token_id, return_tokens=False)
        except ValueError:
            return False
        return True

    def _can_stop(self) -> bool:
        return bool(self._g.is_finished())


class OutlinesDecoder:
    def __init__(self, index: Any, vocab: Vocab, stop_words: np.ndarray, not_stop: np.ndarray) -> None:
        self.index = index
        self._vocab, self._stop_words, self._not_stop = vocab, stop_words, not_stop

    def new_state(self) -> TokenConstraint:
        import outlines_core as oc

        return OutlinesState(oc.Guide(self.index), self._vocab, self._stop_words, self._not_stop)


def choice_regex(choices: tuple[str, ...] | str) -> str:
    items = [choices] if isinstance(choices, str) else list(choices)
    return "(" + "|".join(re.escape(c) for c in items) + ")"


class OutlinesBackend(Backend):
    name = "outlines"
    extra = "outlines"
    module = "outlines_core"
    kinds = frozenset({"json", "json_object", "regex", "choice"})

    def _load(self, vocab: Vocab) -> Any:
        tokens: dict[bytes, list[int]] = {}
        for tid, raw in enumerate(vocab.token_bytes):
            if raw is not None:
                tokens.setdefault(raw, []).append(tid)
        return tokens

    def _compile(self, spec: GuideSpec, data: tuple[Vocab, Any, np.ndarray, np.ndarray],
                 timeout: float) -> OutlinesDecoder:
        vocab, tokens, stop_words, not_stop = data
        ws: str | None = spec.whitespace_pattern or ("" if spec.disable_any_whitespace else None)
        if spec.kind == "json":
            value = str(spec.value)
        elif spec.kind == "json_object":
            value = json.dumps({"type": "object"})
        elif spec.kind == "regex":
            value = strip_anchors(str(spec.value))
        else:
            value = choice_regex(spec.value)
        request = {"kind": spec.kind, "value": value, "whitespace_pattern": ws, "tokens": tokens,
                   "eos": vocab.eos_token_ids[0]}
        index = run_in_worker("outlines", request, timeout, self.lanes, MAX_MB)
        return OutlinesDecoder(index, vocab, stop_words, not_stop)
