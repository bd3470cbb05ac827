"""The per-sequence state every backend shares: one int32 mask buffer, stop handling, termination.

A backend implements ``_compute(buf)`` (write this step's allowed tokens into ``buf``, an int32
numpy array of ``ceil(vocab/32)`` words, without stop ids), ``_advance(token)`` (non-stop token;
False if not allowed) and ``_can_stop()`` (the guide is in an accepting state). The base class
adds the stop ids when the guide may stop, caches the mask between ``is_terminated`` and
``fill_bitmask``, and reports termination once the guide accepted a stop token or may stop with
nothing else to follow. A guide that cannot stop and allows no token is a dead end, not an end:
its mask row is all zero and the engine ends the sequence with an error. After a refused token
(or a backend error) every row is all zero and every token is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from trtserver_guided.vocab import Vocab


class MaskState:
    __slots__ = (
        "_buf",
        "_failed",
        "_not_stop",
        "_stop_ids",
        "_stop_words",
        "_stopped",
        "_tbuf",
        "_valid",
        "_vocab",
    )

    def __init__(self, vocab: Vocab, stop_words: np.ndarray, not_stop: np.ndarray) -> None:
        import torch

        self._vocab = vocab
        self._buf = np.zeros(vocab.words, dtype=np.int32)
        self._tbuf = torch.from_numpy(self._buf)  # shares memory with _buf
        self._valid = False
        self._stopped = False
        self._failed = False
        self._stop_words = stop_words
        self._not_stop = not_stop
        self._stop_ids = frozenset(vocab.eos_token_ids)

    # --- backend hooks ------------------------------------------------------------------------
    def _compute(self, buf: np.ndarray) -> None:
        raise NotImplementedError

    def _advance(self, token_id: int) -> bool:
        raise NotImplementedError

    def _can_stop(self) -> bool:
        raise NotImplementedError

    def _accept_stop(self, token_id: int) -> bool:
        """Accept a stop token; default: allowed iff the guide may stop."""
        return self._can_stop()

    # --- TokenConstraint ----------------------------------------------------------------------
    def _ensure(self) -> np.ndarray:
        if not self._valid:
            if self._stopped or self._failed:
                self._buf[:] = 0
            else:
                self._compute(self._buf)
                if self._can_stop():
                    np.bitwise_or(self._buf, self._stop_words, out=self._buf)
                else:
                    np.bitwise_and(self._buf, self._not_stop, out=self._buf)
            self._valid = True
        return self._buf

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._ensure()
        bitmask[row].copy_(self._tbuf)

    def accept_token(self, token_id: int) -> bool:
        if self._stopped or self._failed:
            return False
        self._valid = False
        if token_id in self._stop_ids:
            ok = self._accept_stop(token_id)
            self._stopped = ok
        else:
            ok = 0 <= token_id < self._vocab.vocab_size and self._vocab.token_bytes[token_id] is not None \
                and self._advance(token_id)
        if not ok:
            self._failed = True
        return bool(ok)

    def is_terminated(self) -> bool:
        if self._stopped:
            return True
        if self._failed:
            return False
        buf = self._ensure()
        return bool(np.any(buf & self._stop_words)) and not bool(np.any(buf & self._not_stop))

    def allowed_token_ids(self) -> list[int]:
        """The ids the mask allows now (for tests and debugging)."""
        from trtserver_guided.vocab import words_to_ids

        return [int(i) for i in words_to_ids(self._ensure(), self._vocab.vocab_size)]
