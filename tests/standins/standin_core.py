"""The scripted "model" shared by the tensorrt_llm stand-ins (test-only; never installed).

A request produces, per step, one token per sequence from ``SCRIPT`` (sequence i is shifted by i),
honouring the sampling params' own names (max_tokens or max_new_tokens, end_id, stop_token_ids,
ignore_eos, n/best_of or beam_width, logprobs / _return_log_probs / return_log_probs).

The prompt is "scored" by :func:`context_logits`: row *i* is the distribution computed at prompt
position *i*, which predicts token *i + 1* (the last row predicts the first generated token), as
TensorRT-LLM's ``context_logits`` are. ``prompt_logprobs`` (0.20+) are made from those rows as
TensorRT-LLM's ``_topk_logprobs(context_logits, k, None)`` makes them: the top k of each row, with
the real next token absent unless it is among them.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCRIPT: list[int] = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]
UNKNOWN = object()


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None


def vocab_size(config: dict[str, Any]) -> int:
    """The model's vocabulary: the engine's ``pretrained_config`` or the HF ``config.json``."""
    return int((config.get("pretrained_config") or config).get("vocab_size") or 64)


def context_logits(prompt: list[int], vocab: int) -> Any:
    """``[len(prompt), vocab]`` float32: position i favours token ``prompt[i] + 1``, then ``+ 2``."""
    import torch

    logits = torch.zeros(len(prompt), vocab, dtype=torch.float32)
    for i, tok in enumerate(prompt):
        logits[i, (tok + 1) % vocab] = 3.0
        logits[i, (tok + 2) % vocab] = 1.0
        logits[i, (tok * 7) % vocab] -= 2.0
    return logits


def generation_logits_row(tok: int, vocab: int) -> Any:
    """The logits a generated token was sampled from: it is favoured, ``tok + 1`` next."""
    import torch

    row = torch.zeros(vocab, dtype=torch.float32)
    row[tok % vocab] = 2.0
    row[(tok + 1) % vocab] = 1.0
    return row


def topk_logprobs(logits: Any, k: int) -> list[dict[int, Logprob]]:
    """TensorRT-LLM's ``_topk_logprobs(logits, k, tokens=None)``: one dict per row, ranks from 1."""
    import torch

    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, indices = torch.topk(logprobs, k=k, dim=-1)
    return [{int(i): Logprob(float(v), r + 1) for r, (v, i) in enumerate(zip(vals, idx, strict=True))}
            for vals, idx in zip(values, indices, strict=True)]


def release(llm: Any) -> tuple[int, int]:
    """The stand-in's ``tensorrt_llm.__version__`` as (major, minor); a test may set another."""
    import sys

    major, minor = str(sys.modules["tensorrt_llm"].__version__).split(".")[:2]
    return int(major), int(minor)


def check_embedding_bias(sp: Any, config: dict[str, Any]) -> None:
    """C++: ``TLLM_CHECK_WITH_INFO(embeddingBias->getShape().d[1] == modelConfig.getVocabSize(), ...)``
    (the PyTorch backend's sampler adds the row to the logits, which fails the same way)."""
    bias = getattr(sp, "embedding_bias", None)
    vocab = vocab_size(config)
    if bias is not None and int(bias.shape[-1]) != vocab:
        try:
            from tensorrt_llm.executor import RequestError
        except ImportError:  # the 0.12 stand-in models no executor module: the C++ error as it is
            RequestError = RuntimeError  # noqa: N806
        raise RequestError("The embedding bias shape is not as expected. Expected last dimension to be "
                           f"same as vocab size: {vocab}.")


def read_engine_config(model: str | Path) -> dict[str, Any]:
    path = Path(model) / "config.json"
    if not path.is_file():
        raise ValueError(f"{path} does not exist")
    return dict(json.loads(path.read_text()))


def check_kwargs(kwargs: dict[str, Any], allowed: set[str]) -> None:
    for key in kwargs:
        if key not in allowed:
            raise ValueError(f"LLM got invalid argument: {key}")


def require_loop() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            "The asyncio event loop was not present during initialization, so async "
            "operations are not available"
        ) from None


def get(sp: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(sp, name, UNKNOWN)
        if value is not UNKNOWN and value is not None:
            return value
    return default


class KvCacheConfigBinding:
    """The C++ ``executor::KvCacheConfig`` binding that 0.12–0.16 re-export (pybind11: keyword
    constructor whose signature Python cannot read, ``enable_block_reuse`` a property, default False)."""

    _args = ("enable_block_reuse", "max_tokens", "max_attention_window", "sink_token_length",
             "free_gpu_memory_fraction", "host_cache_size", "onboard_blocks")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        unknown = [k for k in kwargs if k not in self._args]
        if unknown or len(args) > len(self._args):
            raise TypeError("__init__(): incompatible constructor arguments")
        values = dict(zip(self._args, args, strict=False)) | kwargs
        self._enable_block_reuse = bool(values.get("enable_block_reuse", False))

    @property
    def enable_block_reuse(self) -> bool:
        return self._enable_block_reuse


class PrefixBlocks:
    """The KV-cache blocks a block-reusing executor keeps for later requests: every full block of an
    earlier prompt, keyed by the prefix it ends. A prompt reuses its longest run of stored full blocks,
    never its last token (that one is always computed, for the first output token's logits)."""

    def __init__(self, tokens_per_block: int = 32) -> None:
        self.tokens_per_block = tokens_per_block
        self.blocks: set[tuple[int, ...]] = set()

    def admit(self, prompt: list[int]) -> int:
        """Prompt tokens taken from stored blocks; the prompt's own full blocks are stored after."""
        size = self.tokens_per_block
        reused = 0
        while reused + size <= len(prompt) - 1 and tuple(prompt[:reused + size]) in self.blocks:
            reused += size
        for end in range(size, len(prompt) + 1, size):
            self.blocks.add(tuple(prompt[:end]))
        return reused


class Result:
    """Base of RequestOutput / GenerationResult: mutable, async-iterable (streaming), awaitable."""

    _next_id = 0

    def __init__(self, prompt_token_ids: list[int], outputs: list[Any], *, streaming: bool) -> None:
        Result._next_id += 1
        self.request_id = Result._next_id
        self.prompt_token_ids = prompt_token_ids
        self._outputs = outputs
        self._streaming = streaming
        self._done = False
        self._events: asyncio.Queue[bool] = asyncio.Queue()
        self._finished_event = asyncio.Event()
        self._cancel = False
        self._context_logits: Any = None
        self.task: asyncio.Task[None] | None = None
        self.reused_tokens = 0  # prompt tokens the executor's KV cache served (block reuse)

    def _on_response(self) -> None:
        """What a version's result copies from each executor response (nothing here)."""

    @property
    def context_logits(self) -> Any:
        return self._context_logits

    @property
    def outputs(self) -> list[Any]:
        return self._outputs

    @property
    def finished(self) -> bool:
        return self._done

    def _push(self, final: bool) -> None:
        self._on_response()
        if final:
            self._done = True
            self._finished_event.set()
        if self._streaming or final:
            self._events.put_nowait(final)

    def __aiter__(self) -> Result:
        return self

    async def __anext__(self) -> Result:
        if self._done and self._events.empty():
            raise StopAsyncIteration
        await self._events.get()
        return self

    def __await__(self) -> Any:
        async def wait() -> Result:
            await self._finished_event.wait()
            return self

        return wait().__await__()


async def run(result: Result, sp: Any, llm: Any, *, finish_reasons: bool) -> None:
    """Drive ``result`` through the script; honours the sampling params' own names."""
    script = getattr(llm, "script", None) or SCRIPT
    max_tokens = get(sp, "max_tokens", "max_new_tokens", default=32)
    end_id = get(sp, "end_id")
    stop_ids = list(get(sp, "stop_token_ids", default=[]) or [])
    ignore_eos = bool(get(sp, "ignore_eos", default=False))
    if ignore_eos and release(llm) > (1, 2):
        stop_ids = []  # main's base_worker: stop_words=[] if ignore_eos else _get_stop_words()
    keep_stop = bool(get(sp, "include_stop_str_in_output", default=False))
    want_logits = bool(getattr(sp, "return_generation_logits", False))
    vocab = vocab_size(llm.config)
    top_k = get(sp, "logprobs")
    floats = bool(getattr(sp, "_return_log_probs", False) or get(sp, "return_log_probs", default=False))
    if top_k and not getattr(llm, "trt", True) and release(llm) < (1, 1):
        top_k, floats = None, True  # 1.0's PyTorch sampler: the sampled token's logprob only, as floats
    prompt_lp = get(sp, "prompt_logprobs")
    outs = result.outputs
    blocks = getattr(llm, "kv_blocks", None)
    if blocks is not None:  # the context phase: reuse what earlier prompts left, keep this one's blocks
        result.reused_tokens = blocks.admit(result.prompt_token_ids)
    scores = context_logits(result.prompt_token_ids, vocab_size(llm.config))
    if getattr(sp, "return_context_logits", False):
        result._context_logits = scores
    if prompt_lp:
        outs[0].prompt_logprobs = topk_logprobs(scores, prompt_lp)
    live = list(range(len(outs)))
    for step in range(max_tokens):
        await asyncio.sleep(0)
        if result._cancel:
            for i in live:
                if finish_reasons:
                    outs[i].finish_reason = "cancelled"
            result._push(final=True)
            return
        for i in list(live):
            o = outs[i]
            tok = script[(step + i) % len(script)]
            if end_id is not None and tok == end_id and not ignore_eos:
                _finish(o, "stop", None, finish_reasons)
                live.remove(i)
                continue
            o.token_ids.append(tok)
            if want_logits:  # [length, vocab], as CompletionOutput.generation_logits (trimmed to length)
                import torch

                o.generation_logits = torch.stack([generation_logits_row(t, vocab) for t in o.token_ids])
            if top_k:
                o.logprobs.append({tok: Logprob(-0.25, 1), tok + 1: Logprob(-1.5, 2)})
            elif floats:
                o.logprobs.append(-0.25)
            o.cumulative_logprob = (o.cumulative_logprob or 0.0) - 0.25
            if tok in stop_ids:
                if not keep_stop:  # result.py: token_ids[:-len(stop_ids)] (0.12 handle_generation_msg too)
                    del o.token_ids[-1:]
                    del o.logprobs[len(o.token_ids):]
                _finish(o, "stop", tok, finish_reasons)
                live.remove(i)
            elif len(o.token_ids) >= max_tokens:
                _finish(o, "length", None, finish_reasons)
                live.remove(i)
        if not live:
            break
        result._push(final=False)
    result._push(final=True)


def _finish(o: Any, reason: str, stop_reason: int | None, finish_reasons: bool) -> None:
    if finish_reasons:
        o.finish_reason = reason
        o.stop_reason = stop_reason
