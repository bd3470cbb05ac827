"""A scripted engine for tests: the real server around a tiny synthetic model whose outputs a test writes.

The vocabulary is a byte-level BPE of a few hundred tokens, trained in memory on a built-in text,
with ChatML's special tokens (``<|endoftext|>`` 0, ``<|im_start|>`` 1, ``<|im_end|>`` 2, the EOS)
and a ChatML chat template. ``write_engine_dir(path)`` writes it as an engine directory
(``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``, ``chat_template.jinja``),
which the server reads as it reads a built model's.

What each sequence generates is a *script*: a function of one ``ScriptCall`` (the prompt's token
ids, the sampling parameters, the sequence's index, the tokenizer) returning the text or the token
ids to emit. Text is encoded and ends with EOS; token ids are emitted as given (an iterable may be
endless). The default script, ``echo``, repeats the prompt's non-special tokens, then EOS.

The engine honours what a real engine does with its request: ``max_tokens`` and the context length
(``"length"``), EOS unless ``ignore_eos`` and ``stop_token_ids`` (``"stop"``; a stop token is
reported in ``stop_token_id``), ``min_tokens`` (ending tokens before it are skipped), ``n``
sequences, ``abort``, and the request's logits processors and guide: when a request has either,
each step builds a logits row (a float32 torch tensor of the vocabulary's size, 1.0 at the scripted
token, 0.0 elsewhere), runs the processors and the guide's mask on it, and emits its argmax (the
lowest id among ties), so a processor that bans the scripted token visibly changes the output.
A script that runs out ends the sequence with EOS (with ``ignore_eos``, with ``"length"``).
Logprobs are well-formed and fake: the emitted token has log(1/2), the k-th alternative
(the ids after it) log(1/2**(k+1)); prompt logprobs likewise.

Serve it with ``ScriptedEngines(script)`` registered as a plugin and ``engine="scripted"``; the
``trtserver.testing`` fixtures do both. This module imports neither torch nor aiohttp at import time.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from trtserver.chat_template import TEMPLATE_FILE
from trtserver.engine.base import (
    Capabilities,
    EngineBase,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    LogitsProcessor,
    SamplingParams,
    SequenceOutput,
    TokenConstraint,
)
from trtserver.hookspecs import hookimpl
from trtserver.tokenizer import SPECIAL_TOKEN_NAMES, Tokenizer

if TYPE_CHECKING:
    import torch

    from trtserver.config import ServerConfig

ENGINE_NAME = "scripted"
MODEL_NAME = "scripted-model"
CONTEXT_LENGTH = 4096
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN, EOS_TOKEN = "<|im_start|>", "<|im_end|>"
VOCAB_SIZE = 512
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CORPUS = (
    "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid.",
    "Hello world! Hello, how are you today? I am fine, thank you, and you?",
    "Tell me about dragons, lava and volcanoes. Dragons fly over the mountains at night.",
    "One two three four five six seven eight nine ten. 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100",
    "The quick brown fox jumps over the lazy dog. A cat sat on the mat with a hat.",
    "def main():\n    print('hello')\n    return {\"name\": \"value\", \"items\": [1, 2, 3]}\n",
    "user assistant system the a an of in on to is are was be this that with for and or not",
    "Yes. No. Maybe! What? Why? Because it is so. Please write a short story about a robot.",
)

SCRIPTED_LOGPROB = math.log(0.5)


@dataclass(frozen=True, slots=True)
class ScriptCall:
    """What a script sees for one sequence."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    index: int  # which of the request's ``n`` sequences
    tokenizer: Tokenizer

    @property
    def prompt_text(self) -> str:
        """The prompt without its special tokens."""
        return self.tokenizer.decode(self.prompt_token_ids, skip_special_tokens=True)


Script = Callable[[ScriptCall], "str | Iterable[int]"]


def echo(call: ScriptCall) -> list[int]:
    """The default script: the prompt's non-special tokens, then EOS."""
    specials = call.tokenizer.special_token_ids
    return [t for t in call.prompt_token_ids if t not in specials] + [call.tokenizer.eos_token_ids[0]]


def reply(text: str) -> Script:
    """A script that answers every sequence with ``text`` (then EOS)."""
    return lambda call: text


# --- the vocabulary -------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(_CORPUS, trainer)
    return str(backend.to_str())


def _tokenizer_config() -> dict[str, Any]:
    return {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": SPECIAL_TOKENS[0], "pad_token": EOS_TOKEN,
            "add_bos_token": False, "model_max_length": CONTEXT_LENGTH}


def scripted_tokenizer() -> Tokenizer:
    """The synthetic vocabulary as a ``Tokenizer`` (a fresh object each call; trained once a process)."""
    backend = tokenizers.Tokenizer.from_str(_tokenizer_json())
    return Tokenizer(backend, bos_token_id=backend.token_to_id(BOS_TOKEN),
                     eos_token_ids=(SPECIAL_TOKENS.index(EOS_TOKEN),),
                     add_bos_token=False, special_tokens={name: text for name, text in _tokenizer_config().items()
                                                          if name in SPECIAL_TOKEN_NAMES})


def write_engine_dir(path: str | Path) -> Path:
    """Write the synthetic model's tokenizer and chat template as an engine directory at ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2), encoding="utf-8")
    backend = tokenizers.Tokenizer.from_str(_tokenizer_json())
    generation = {"bos_token_id": backend.token_to_id(BOS_TOKEN), "eos_token_id": backend.token_to_id(EOS_TOKEN)}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    (path / TEMPLATE_FILE).write_text(CHAT_TEMPLATE, encoding="utf-8")
    return path


# --- the engine -----------------------------------------------------------------------------


@dataclass(slots=True)
class _Sequence:
    index: int
    script: Iterator[int]
    processors: list[LogitsProcessor]
    constraint: TokenConstraint | None
    output: list[int] = field(default_factory=list)
    finished: bool = False


class ScriptedEngine(EngineBase):
    """An ``Engine`` that emits what its script says, one token per sequence a step."""

    def __init__(self, config: ServerConfig, script: Script = echo, *, step_delay_s: float = 0.0) -> None:
        self.config = config
        self.script = script
        self.step_delay_s = step_delay_s
        self.tokenizer = Tokenizer.from_dir(config.engine_path)
        context = min(CONTEXT_LENGTH, config.max_model_len or CONTEXT_LENGTH)
        self.info = EngineInfo(
            model_name=MODEL_NAME, context_length=context, vocab_size=self.tokenizer.vocab_size,
            eos_token_ids=self.tokenizer.eos_token_ids,
            capabilities=Capabilities(beam_search=False, adapters=False, max_logprobs=20),
            fingerprint_inputs={"engine": ENGINE_NAME, "vocab_size": self.tokenizer.vocab_size},
            backend=ENGINE_NAME,
        )
        self._aborted: dict[str, set[int] | None] = {}  # request id -> indexes (None: all)
        self._running = 0
        self.requests: list[GenerationRequest] = []
        """Every request generated, in order: what the server asked of the engine."""

    async def start(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None

    def abort(self, request_id: str, index: int | None = None) -> None:
        if index is None:
            self._aborted[request_id] = None
        else:
            indexes = self._aborted.setdefault(request_id, set())
            if indexes is not None:
                indexes.add(index)

    def stats(self) -> EngineStats:
        return EngineStats(running=self._running, slots_total=self.config.max_batch_size,
                           slots_used=min(self._running, self.config.max_batch_size))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[SequenceOutput]:
        self.requests.append(request)
        sequences = [self._sequence(request, i) for i in range(request.n)]
        self._running += len(sequences)
        live = len(sequences)
        try:
            first = True
            while live:
                for seq in sequences:
                    if seq.finished:
                        continue
                    delta = self._step(request, seq)
                    if first and seq.index == 0:
                        self._add_prompt_logprobs(request, delta)
                        first = False
                    if seq.finished:
                        live -= 1
                        self._running -= 1
                    yield delta
                await asyncio.sleep(self.step_delay_s)
        finally:
            self._running -= live
            self._aborted.pop(request.request_id, None)

    def _sequence(self, request: GenerationRequest, index: int) -> _Sequence:
        answer = self.script(ScriptCall(list(request.prompt_token_ids), request.sampling, index, self.tokenizer))
        if isinstance(answer, str):
            answer = [*self.tokenizer.encode(answer, add_special_tokens=False), self.tokenizer.eos_token_ids[0]]
        return _Sequence(index, iter(answer), [factory() for factory in request.logits_processors],
                         request.guided.new_state() if request.guided is not None else None)

    def _is_aborted(self, request_id: str, index: int) -> bool:
        if request_id not in self._aborted:
            return False
        indexes = self._aborted[request_id]
        return indexes is None or index in indexes

    def _step(self, request: GenerationRequest, seq: _Sequence) -> SequenceOutput:
        p = request.sampling
        delta = SequenceOutput(request_id=request.request_id, index=seq.index, token_ids=[],
                               num_prompt_tokens=len(request.prompt_token_ids))
        if self._is_aborted(request.request_id, seq.index):
            return self._finish(seq, delta, "abort")
        if p.max_tokens == 0:
            return self._finish(seq, delta, "length")
        eos = () if p.ignore_eos else self.tokenizer.eos_token_ids
        ends = set(p.stop_token_ids) | set(eos)
        token = next(seq.script, None)
        while token is not None and token in ends and len(seq.output) < p.min_tokens:
            token = next(seq.script, None)
        if token is None:
            if p.ignore_eos:
                return self._finish(seq, delta, "length")
            token = eos[0]
        if seq.processors or seq.constraint is not None:
            token = self._steer(seq, token)
        seq.output.append(token)
        delta.token_ids = [token]
        if p.logprobs is not None:
            delta.logprobs = [SCRIPTED_LOGPROB]
            delta.top_logprobs = [self._top(token, p.logprobs)]
            delta.cumulative_logprob = SCRIPTED_LOGPROB * len(seq.output)
        if seq.constraint is not None:
            seq.constraint.accept_token(token)
            if seq.constraint.is_terminated():
                return self._finish(seq, delta, "stop")
        if token in p.stop_token_ids:
            delta.stop_token_id = token
            return self._finish(seq, delta, "stop")
        if token in eos:
            return self._finish(seq, delta, "stop")
        if len(seq.output) >= p.max_tokens or len(request.prompt_token_ids) + len(seq.output) >= \
                self.info.context_length:
            return self._finish(seq, delta, "length")
        return delta

    @staticmethod
    def _finish(seq: _Sequence, delta: SequenceOutput, reason: Any) -> SequenceOutput:
        seq.finished = True
        delta.finish_reason = reason
        return delta

    def _steer(self, seq: _Sequence, token: int) -> int:
        """The scripted token through the processors and the guide: the argmax of the row they leave."""
        import torch

        row = torch.zeros(self.info.vocab_size, dtype=torch.float32)
        row[token] = 1.0
        for processor in seq.processors:
            processor(list(seq.output), row)
        if seq.constraint is not None:
            row.masked_fill_(~_allowed(seq.constraint, self.info.vocab_size), float("-inf"))
        return int(torch.argmax(row).item())

    def _top(self, token: int, k: int) -> list[tuple[int, float]]:
        vocab = self.info.vocab_size
        return [((token + i) % vocab, SCRIPTED_LOGPROB * (i + 1)) for i in range(min(k, vocab))]

    def _add_prompt_logprobs(self, request: GenerationRequest, delta: SequenceOutput) -> None:
        k = request.sampling.prompt_logprobs
        if k is None:
            return
        ids = request.prompt_token_ids
        delta.prompt_token_logprobs = [None] + [SCRIPTED_LOGPROB] * (len(ids) - 1)
        delta.prompt_logprobs = [None] + [self._top(t, k) for t in ids[1:]]


def _allowed(constraint: TokenConstraint, vocab_size: int) -> torch.Tensor:
    """The guide's allowed tokens, from the bitmask it fills (bit ``t % 32`` of word ``t // 32``)."""
    import torch

    bitmask = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)
    constraint.fill_bitmask(bitmask, 0)
    bits = (bitmask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab_size].bool()


class ScriptedEngines:
    """A plugin registering ``--engine scripted``: a ``ScriptedEngine`` running ``script``."""

    def __init__(self, script: Script = echo, *, step_delay_s: float = 0.0) -> None:
        self.script = script
        self.step_delay_s = step_delay_s
        self.engines: list[ScriptedEngine] = []
        """The engines built (one per app started with this plugin)."""

    @hookimpl
    def trtserver_register_engines(self, register: Callable[[str, Callable[[ServerConfig], Any]], None]) -> None:
        register(ENGINE_NAME, self._build)

    def _build(self, config: ServerConfig) -> ScriptedEngine:
        engine = ScriptedEngine(config, self.script, step_delay_s=self.step_delay_s)
        self.engines.append(engine)
        return engine
