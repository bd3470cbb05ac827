"""The contract between the serving layer and an engine.

Engines take token ids in and give token ids (with logprobs) out; text is made in one place,
``trtserver/text.py``, so every engine detokenizes and stops identically. Nothing here imports
torch: the per-step objects plugins return (``TokenConstraint``, ``LogitsProcessor``) receive
tensors, but their types are only named for type checkers.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from trtserver.guided import GuideContext, GuideSpec
    from trtserver.tokenizer import Tokenizer

FinishReason = Literal["stop", "length", "abort"]


class Priority(enum.IntEnum):
    """Lower value is admitted first."""

    HIGH = 0
    NORMAL = 1
    LOW = 2
    LOWEST = 3


@runtime_checkable
class TokenConstraint(Protocol):
    """Per-sequence state of a compiled guide (grammar, regex, JSON schema, choice).

    The engine calls these once per decode step for each constrained sequence. The mask format
    is the one xgrammar uses, so every backend fills the same thing: an int32 tensor of shape
    ``(batch, ceil(vocab_size / 32))`` where bit ``t % 32`` of word ``t // 32`` set means token
    ``t`` is allowed.
    """

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits of this sequence into ``bitmask[row]``."""

    def accept_token(self, token_id: int) -> bool:
        """Advance on the sampled token; return False if the token was not allowed."""

    def is_terminated(self) -> bool:
        """True when the guide is complete: the engine ends the sequence with "stop"."""


class GuidedDecoder(Protocol):
    """A compiled guide, shared by every sequence of a request (and cached across requests)."""

    def new_state(self) -> TokenConstraint:
        """Fresh per-sequence state."""


# what a guided decoding plugin registers under a backend name (``trtserver_register_guided_backends``)
GuidedBackend = Callable[["GuideSpec", "GuideContext"], GuidedDecoder]


class LogitsProcessor(Protocol):
    """Per-sequence logits hook, called once per decode step for its row only.

    ``output_token_ids`` are the tokens generated so far for this sequence; ``logits`` is the
    1-D float row for the next token, which the processor modifies in place.
    """

    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> None: ...


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Everything an engine needs to choose tokens; built from a request by ``serving/checks.py``."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    # number of top alternatives to return per generated token; None = no logprobs at all
    logprobs: int | None = None
    # number of top alternatives per prompt token; None = no prompt logprobs
    prompt_logprobs: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


@dataclass(slots=True)
class GenerationRequest:
    """One prompt, generating ``n`` sequences (``best_of`` samples or the beam width)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    n: int = 1
    priority: Priority = Priority.NORMAL
    adapter: str | None = None
    # one factory call per sequence, so per-sequence state is never shared
    guided: GuidedDecoder | None = None
    # the guide as asked for: engines with native guided decoding (TensorRT-LLM's xgrammar) use it
    guide_spec: GuideSpec | None = None
    guide_backend: str | None = None
    logits_processors: Sequence[Callable[[], LogitsProcessor]] = ()


@dataclass(slots=True)
class SequenceOutput:
    """A delta for one sequence of a request: what is new since the previous delta.

    ``logprobs`` (when requested) has one float per new token; ``top_logprobs`` one list per new
    token. ``prompt_logprobs`` rides on the first delta of sequence 0 only: one entry per prompt
    token, the first being None. ``finish_reason`` is set on the last delta of the sequence;
    ``stop_token_id`` says which stop token (EOS excluded) ended it.

    Beam search yields nothing until done, then one delta per returned beam holding the whole
    sequence, with ``cumulative_logprob`` set to the beam score.
    """

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_token_logprobs: list[float | None] | None = None
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    cumulative_logprob: float = 0.0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt's tokens, those whose K/V came from the prefix cache


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What an engine can do; serving refuses with a 400 whatever is False."""

    prompt_logprobs: bool = True
    beam_search: bool = True
    logits_processors: bool = True
    guided_decoding: bool = True
    multiple_sequences: bool = True  # n / best_of > 1 inside the engine
    abort: bool = True
    priority: bool = True
    adapters: bool = False
    max_logprobs: int = 20
    prefix_caching: bool = False  # deltas report num_cached_tokens: usage carries prompt_tokens_details


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model_name: str
    context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    capabilities: Capabilities = field(default_factory=Capabilities)
    # manifest facts that identify this build: fed to the system_fingerprint hook
    fingerprint_inputs: dict[str, Any] = field(default_factory=dict)
    backend: str = "torch"


class Engine(Protocol):
    """What every engine implements (PyTorch, TensorRT-LLM, or a plugin's)."""

    @property
    def info(self) -> EngineInfo: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[SequenceOutput]:
        """Stream deltas for every sequence of ``request``, interleaved, until all finish.

        Closing the iterator early (``aclose()``) aborts whatever is still running.
        """
        ...

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Stop one sequence (``index``) or the whole request; safe to call twice or late."""
        ...

    def stats(self) -> EngineStats: ...

    def check(self, request: GenerationRequest) -> list[tuple[str, str]]:
        """What this engine must refuse in ``request``, as (param, reason); the server answers 400
        naming the first. Checks that need only the capabilities are the server's."""
        ...

    @property
    def failure(self) -> str | None:
        """Why the engine can no longer serve (``/health`` answers 503 with it), or None."""
        ...

    @property
    def threads_bound(self) -> bool:
        """The engine bound its threads to CPUs: the server pins its event loop to the CPU left."""
        ...


class EngineBase:
    """Defaults for the ``Engine`` members most engines need not change; subclass it, and set ``info`` and
    ``tokenizer`` in ``__init__``."""

    info: EngineInfo
    tokenizer: Tokenizer

    def check(self, request: GenerationRequest) -> list[tuple[str, str]]:
        return []

    @property
    def failure(self) -> str | None:
        return None

    @property
    def threads_bound(self) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    slots_total: int = 0
    slots_used: int = 0
    prefix_cache_hit_tokens: int = 0  # prompt tokens served from the prefix cache, since start
    prefix_cache_miss_tokens: int = 0  # prompt tokens computed, since start (while the cache is on)
