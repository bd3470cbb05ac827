"""Small stand-ins shared by the engine and unit tests."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest
import torch


class AllowedTokens:
    """A TokenConstraint (and GuidedDecoder) stand-in: only ``allowed`` tokens may be sampled;
    terminated after ``steps`` accepted tokens (never when ``steps`` is None)."""

    def __init__(self, allowed: Iterable[int], steps: int | None = None) -> None:
        self.allowed, self.steps = frozenset(allowed), steps
        self.accepted: list[int] = []

    def new_state(self) -> AllowedTokens:
        return AllowedTokens(self.allowed, self.steps)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        for t in self.allowed:
            bitmask[row, t // 32] |= 1 << (t % 32)

    def accept_token(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return token_id in self.allowed

    def is_terminated(self) -> bool:
        return self.steps is not None and len(self.accepted) >= self.steps


class BanToken:
    """A LogitsProcessor stand-in that never lets ``token`` be chosen (holds whatever it is given)."""

    def __init__(self, token: int, holds: object = None) -> None:
        self.token, self.tokenizer = token, holds

    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> None:
        logits[self.token] = float("-inf")



def _cpu_packs_bfloat16() -> bool:
    from trtserver.engine.torch.cpu.weights import can_pack_for_cpu

    return can_pack_for_cpu(torch.bfloat16)


# the CPU paths built on oneDNN's packed bfloat16 GEMMs (int4/int8 decode kernels' batch path, batch
# invariance in bfloat16) exist only on CPUs with AVX-512 or AVX-NE-CONVERT; elsewhere the engine uses float32
NEEDS_BF16_PACKING = pytest.mark.skipif(
    not _cpu_packs_bfloat16(),
    reason="this CPU has no AVX-512 (or AVX-NE-CONVERT): oneDNN cannot pack bfloat16 weights here, so the "
           "engine serves float32 and this bfloat16 path does not exist")
