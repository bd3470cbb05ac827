"""Per-sequence and per-request state of the PyTorch engine. Plain Python, no torch."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trtserver.engine.base import FinishReason, GenerationRequest, SamplingParams

if TYPE_CHECKING:
    import torch

    from trtserver.engine.base import LogitsProcessor, TokenConstraint
    from trtserver.engine.torch.beam import BeamState
    from trtserver.engine.torch.lora import LoraAdapter

_arrival = itertools.count()


class Status(enum.Enum):
    WAITING = 0  # queued, no slot yet
    PREFILL = 1  # slot held, prompt being computed
    RUNNING = 2  # decoding
    FINISHED = 3


@dataclass(eq=False, slots=True)
class Sequence:
    """One generated sequence: its slot in the KV cache and everything sampled so far."""

    group: Group
    index: int
    slot: int = -1
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # positions of prompt + output whose K/V sit in the cache
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    # per-sequence sampling state, owned by the engine (types named for type checkers only: no torch here)
    generator: torch.Generator | None = None
    processors: list[LogitsProcessor] = field(default_factory=list)
    constraint: TokenConstraint | None = None
    # what the next delta carries (the engine appends, the runner drains)
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[float] = field(default_factory=list)
    pending_top: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def prompt_ids(self) -> list[int]:
        return self.group.request.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.group.request.sampling

    @property
    def total_len(self) -> int:
        return len(self.group.request.prompt_token_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.group.request.prompt_token_ids[-1]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(eq=False, slots=True)
class Group:
    """One request: ``n`` sequences (samples or beams) sharing one prompt and one prefill."""

    request: GenerationRequest
    seqs: list[Sequence] = field(default_factory=list)
    arrival: int = field(default_factory=lambda: next(_arrival))
    prefill_pos: int = 0  # prompt tokens computed so far, in ``prefill_slot``
    prefill_slot: int = -1  # sequence 0's slot at admission; copied to the others when done
    cached_tokens: int = 0  # prompt tokens whose K/V the prefix cache supplied (prefill starts there)
    # prompt logprobs, filled during prefill, sent with sequence 0's first delta
    prompt_token_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_sent: bool = False
    beam: BeamState | None = None  # when use_beam_search
    adapter: LoraAdapter | None = None  # loaded when the engine admits the request

    @classmethod
    def from_request(cls, request: GenerationRequest) -> Group:
        group = cls(request)
        group.seqs = [Sequence(group, i) for i in range(max(1, request.n))]
        if request.sampling.prompt_logprobs is not None:
            group.prompt_token_logprobs = [None]
            group.prompt_top_logprobs = [None]
        return group

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def priority(self) -> int:
        return int(self.request.priority)

    @property
    def num_slots(self) -> int:
        return len(self.seqs)

    @property
    def prefill_done(self) -> bool:
        return self.prefill_pos >= self.prompt_len

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.seqs)
