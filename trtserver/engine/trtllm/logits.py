"""Our per-sequence work inside TensorRT-LLM's per-request logits processor hook.

TRT-LLM (0.19+) calls ``processor(req_id, logits, token_ids, stream_ptr, client_id)`` once per step:
``logits`` is 3-D (``[beam, 1, vocab_padded]`` as far as the examples show), ``token_ids`` is
beam × tokens so far, prompt included (the PyTorch backend passes each beam's whole token list), so
the length seen on the first call is taken as the start of generation; on the TensorRT backend the
work must be enqueued on ``torch.cuda.ExternalStream(stream_ptr)``. The object crosses a pickle boundary when the
executor worker is another process, so it is a module-level class holding picklable inputs and
building its per-sequence state lazily on the first call. torch is imported only when called.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from trtserver.engine.base import GuidedDecoder, LogitsProcessor, TokenConstraint


class TrtllmLogitsProcessor:
    """Guide mask, plugin logits processors and (where TRT-LLM lacks embedding_bias) logit bias."""

    def __init__(self, *, guided: GuidedDecoder | None = None,
                 processors: Sequence[Callable[[], LogitsProcessor]] = (),
                 logit_bias: Sequence[tuple[int, float]] = (), allowed_token_ids: Sequence[int] | None = None,
                 eos_ids: Sequence[int] = ()) -> None:
        self.guided = guided
        self.factories = tuple(processors)
        self.logit_bias = tuple(logit_bias)
        self.allowed = tuple(allowed_token_ids) if allowed_token_ids is not None else None
        self.eos_ids = tuple(eos_ids)
        self._state: TokenConstraint | None = None
        self._procs: list[LogitsProcessor] | None = None
        self._start: int | None = None
        self._fed = 0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_state=None, _procs=None, _start=None, _fed=0)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __call__(self, req_id: int, logits: torch.Tensor, token_ids: list[list[int]],
                 stream_ptr: int | None = None, client_id: int | None = None) -> None:
        import torch

        ids = list(token_ids[0]) if token_ids else []
        if self._start is None:
            self._start = len(ids)
            if self.guided is not None:
                self._state = self.guided.new_state()
            self._procs = [factory() for factory in self.factories]
        generated = ids[self._start:]
        if self._state is not None:
            for tok in generated[self._fed:]:
                self._state.accept_token(tok)
        self._fed = len(generated)
        stream: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if stream_ptr is not None and logits.is_cuda:
            stream = torch.cuda.stream(torch.cuda.ExternalStream(stream_ptr))
        with stream:
            row = logits.view(-1, logits.shape[-1])[0]
            for proc in self._procs or ():
                proc(generated, row)
            if self.logit_bias:
                index = torch.tensor([t for t, _ in self.logit_bias], dtype=torch.long)
                values = torch.tensor([v for _, v in self.logit_bias], dtype=row.dtype)
                row.index_add_(0, index.to(row.device, non_blocking=True),
                               values.to(row.device, non_blocking=True))
            allowed = self._allowed_mask(row.shape[-1])
            if allowed is not None:
                row.masked_fill_(~allowed.to(row.device, non_blocking=True), float("-inf"))

    def _allowed_mask(self, width: int) -> torch.Tensor | None:
        import torch

        mask: torch.Tensor | None = None
        if self.allowed is not None:
            mask = torch.zeros(width, dtype=torch.bool)
            mask[list(self.allowed)] = True
        if self._state is not None:
            if self._state.is_terminated():
                guide = torch.zeros(width, dtype=torch.bool)
                guide[list(self.eos_ids)] = True
            else:
                guide = guide_mask(self._state, width)
                if not guide.any():  # a dead end: end the sequence rather than sample from all -inf
                    guide[list(self.eos_ids)] = True
            mask = guide if mask is None else mask & guide
        return mask


def guide_mask(state: TokenConstraint, width: int) -> torch.Tensor:
    """The constraint's xgrammar-format bitmask as a bool row of ``width`` (padding disallowed)."""
    import torch

    words = (width + 31) // 32
    bitmask = torch.zeros((1, words), dtype=torch.int32)
    state.fill_bitmask(bitmask, 0)
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask[0].unsqueeze(1) >> shifts) & 1
    return bits.reshape(-1)[:width].bool()
