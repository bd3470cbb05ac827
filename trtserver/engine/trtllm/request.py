"""GenerationRequest -> TensorRT-LLM ``SamplingParams`` keywords, per probed API generation.

Pure: the keyword dict is built here and the engine constructs the real ``SamplingParams`` from it,
so a name this version does not have fails loudly in the library's own constructor (TypeError).
Rules follow ``mapping.RULES``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from trtserver.engine.base import GenerationRequest, Priority
from trtserver.engine.trtllm.mapping import logprobs_without_streaming_abort, native_guide
from trtserver.engine.trtllm.version import ApiFeatures, Generation

# Priority -> TRT-LLM's float in [0, 1]; higher runs first; 0.5 is its default
PRIORITY_VALUES = {Priority.HIGH: 1.0, Priority.NORMAL: 0.5, Priority.LOW: 0.25, Priority.LOWEST: 0.0}
_SEED_MASK = (1 << 64) - 1


@dataclass(slots=True)
class Prepared:
    """What the engine needs to submit one request and to read its stream back."""

    kwargs: dict[str, Any]
    """SamplingParams keywords."""
    attrs: dict[str, Any] = field(default_factory=dict)
    """Set on the SamplingParams after construction (private ``_return_log_probs``)."""
    our_stop_ids: frozenset[int] = frozenset()
    """Stop ids TRT-LLM is not told about: the stream reader ends the sequence on them."""
    max_tokens: int = 16
    """What the client asked for (the engine may have been sent 1 for a 0)."""
    streaming: bool = True
    abortable: bool = True
    embedding_bias: list[tuple[int, float]] | None = None
    """(token, bias) pairs; ``allowed_only`` turns every other token to -inf."""
    allowed_only: tuple[int, ...] | None = None
    logits_logprobs: bool = False
    """Logprobs are computed by the stream reader from ``generation_logits``."""


def _early_stopping(value: bool | str) -> int:
    return {True: 1, False: 0, "never": 2}[value]  # type: ignore[index]


def prepare(request: GenerationRequest, f: ApiFeatures, *, eos_ids: tuple[int, ...],
            pad_id: int | None = None, rng: random.Random | None = None) -> Prepared:
    """SamplingParams keywords for ``request``; assumes ``refusals()`` found nothing."""
    s = request.sampling
    kw: dict[str, Any] = {}
    prep = Prepared(kwargs=kw, max_tokens=s.max_tokens)

    def put(value: Any, *names: str) -> None:
        name = f.name(*names)
        if name is None:
            raise KeyError(f"TensorRT-LLM {f.version} SamplingParams has none of {names}")
        kw[name] = value

    # token ids out, text made by us
    if eos_ids:
        kw["end_id"] = eos_ids[0]
    pad = pad_id if pad_id is not None else (eos_ids[0] if eos_ids else None)
    if pad is not None:
        kw["pad_id"] = pad
    if "detokenize" in f.sampling_fields:
        kw["detokenize"] = False
    # max_tokens: always set, TRT-LLM's default is 32 and None/0 means "up to max_seq_len"
    put(max(s.max_tokens, 1), "max_tokens", "max_new_tokens")
    # seed: always set; an unset seed is the C++ default 0, so unseeded requests would sample alike
    seed = s.seed if s.seed is not None else (rng or random).getrandbits(63)
    put(seed & _SEED_MASK, "seed", "random_seed")
    # sampling
    if s.greedy:
        kw["top_k"] = 1
    else:
        kw["temperature"] = s.temperature
        kw["top_p"] = s.top_p
        if s.top_k > 0:
            kw["top_k"] = s.top_k
        if s.min_p:
            kw["min_p"] = s.min_p
    if s.min_tokens:
        put(s.min_tokens, "min_tokens", "min_length")
    if s.frequency_penalty:
        kw["frequency_penalty"] = s.frequency_penalty
    if s.presence_penalty:
        kw["presence_penalty"] = s.presence_penalty
    if s.repetition_penalty != 1.0:
        kw["repetition_penalty"] = s.repetition_penalty
    if s.ignore_eos:
        if "ignore_eos" in f.sampling_fields:
            kw["ignore_eos"] = True
        else:
            kw["end_id"] = -1  # what 0.15+'s worker sends for ignore_eos; before 0.15 it reaches C++ as is
    # stop token ids (extra EOS ids too: TRT-LLM knows one end_id)
    stop_ids = list(s.stop_token_ids)
    if not s.ignore_eos:
        stop_ids += [t for t in eos_ids[1:] if t not in stop_ids]
    if stop_ids:
        if "stop_token_ids" in f.sampling_fields:
            kw["stop_token_ids"] = stop_ids
            if "include_stop_str_in_output" in f.sampling_fields:
                # TRT-LLM would cut the matched stop token from token_ids; the torch engine keeps it
                kw["include_stop_str_in_output"] = True
            if s.ignore_eos:
                # main's worker drops every stop word when ignore_eos is set: stop on them ourselves too
                prep.our_stop_ids = frozenset(stop_ids)
        else:
            prep.our_stop_ids = frozenset(stop_ids)
    # several sequences / beams
    if s.use_beam_search:
        if "use_beam_search" in f.sampling_fields:
            kw.update(use_beam_search=True, n=request.n, best_of=request.n)
        else:
            kw["beam_width"] = request.n
        kw["length_penalty"] = s.length_penalty
        if "early_stopping" in f.sampling_fields:
            kw["early_stopping"] = _early_stopping(s.early_stopping)
    elif request.n > 1:
        # every sample comes back; best_of ranking is ours (serving/completions.py)
        kw.update(n=request.n, best_of=request.n)
    # logprobs
    if s.logprobs is not None:
        if "logprobs" in f.sampling_fields:
            if f.trt_backend and not f.gather_generation_logits:
                # the sampled token's logprob without gathering logits (what trtllm-serve does)
                prep.attrs["_return_log_probs"] = True
            else:
                kw["logprobs"] = max(s.logprobs, 1)
        elif s.logprobs > 0 and f.logits_logprobs:
            kw["return_generation_logits"] = True
            prep.logits_logprobs = True
        else:
            kw["return_log_probs"] = True
    if s.prompt_logprobs is not None:
        # scored by us from the context logits (TRT-LLM's prompt_logprobs omit the real token)
        kw["return_context_logits"] = True
    # logit bias / allowed ids natively when embedding_bias exists and no processor is needed anyway
    if (s.logit_bias or s.allowed_token_ids is not None) and "embedding_bias" in f.sampling_fields:
        prep.embedding_bias = list(s.logit_bias)
        prep.allowed_only = s.allowed_token_ids
    # streaming and abort: #10810, and beam search comes back whole
    avoid = s.logprobs is not None and logprobs_without_streaming_abort(f)
    # generation logits are read whole from the final result
    prep.streaming = not s.use_beam_search and not avoid and not prep.logits_logprobs
    prep.abortable = f.has_abort and not avoid
    return prep


def generate_kwargs(request: GenerationRequest, f: ApiFeatures) -> dict[str, Any]:
    """Keywords for ``generate_async`` beyond inputs/sampling_params/streaming (only names it has)."""
    kw: dict[str, Any] = {}
    if f.priority:
        kw["priority"] = PRIORITY_VALUES[request.priority]
    return kw


def guided_kwargs(request: GenerationRequest, f: ApiFeatures) -> dict[str, Any] | None:
    """``GuidedDecodingParams`` keywords when the guide goes to TRT-LLM's xgrammar; else None."""
    if not native_guide(request, f):
        return None
    from trtserver.engine.trtllm.mapping import guide_of

    spec, _ = guide_of(request)
    assert spec is not None
    if spec.kind == "json":
        return {"json": spec.value}
    if spec.kind == "json_object":
        return {"json_object": True}
    if spec.kind == "regex":
        return {"regex": spec.value}
    return {"grammar": spec.value}


def llm_kwargs(f: ApiFeatures, *, tokenizer_dir: str, tp: int, pp: int,
               lora: dict[str, Any] | None, kv_cache_config: Any = None) -> dict[str, Any]:
    """Constructor keywords besides ``model`` (TRT-LLM forbids unknown ones)."""
    kw: dict[str, Any] = {"tokenizer": tokenizer_dir}
    if kv_cache_config is not None:
        kw["kv_cache_config"] = kv_cache_config
    if f.generation is Generation.V1_PYTORCH:
        if tp > 1:
            kw["tensor_parallel_size"] = tp
        if pp > 1:
            kw["pipeline_parallel_size"] = pp
        if f.pytorch_beam_width > 1 and f.llm_accepts("max_beam_width"):
            kw["max_beam_width"] = f.pytorch_beam_width
            if f.release < (1, 2, 0):
                # 1.0's beam search is the TRT-LLM sampler's, without overlap scheduler or CUDA graphs
                beam = {"enable_trtllm_sampler": True, "disable_overlap_scheduler": True, "cuda_graph_config": None}
                kw.update({k: v for k, v in beam.items() if f.llm_accepts(k)})
    # TP/PP of a prebuilt engine come from the engine's mapping (a different value raises)
    if f.gather_generation_logits:
        kw["gather_generation_logits"] = True
    if f.guided_backend is not None:
        kw["guided_decoding_backend"] = f.guided_backend
    if lora is not None:
        kw.update(lora)
    return kw
