"""1.2.0rc2 SamplingParams field list (ref §2), GuidedDecodingParams (§3.1), LogitsProcessor (§3.3)."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, kw_only=True)
class GuidedDecodingParams:
    json: Any = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def _validate(self) -> None:
        count = sum(1 for v in (self.json, self.regex, self.grammar, self.structural_tag) if v is not None)
        count += int(self.json_object)
        if count > 1:
            raise ValueError(f"Only one guide can be used for a request, but got {count}.")


class LogitsProcessor(ABC):
    @abstractmethod
    def __call__(
        self,
        req_id: int,
        logits: Any,
        token_ids: list[list[int]],
        stream_ptr: int | None,
        client_id: int | None,
    ) -> None: ...


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    bad: Any = None
    bad_token_ids: list[int] | None = None
    stop: Any = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    embedding_bias: Any = None
    logits_processor: Any = None
    apply_batched_logits_processor: bool = False
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    top_p: float | None = None
    top_p_min: float | None = None
    top_p_reset_ids: int | None = None
    top_p_decay: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    beam_search_diversity_rate: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    prompt_ignore_length: int | None = None
    length_penalty: float | None = None
    early_stopping: int | None = None
    no_repeat_ngram_size: int | None = None
    min_p: float | None = None
    beam_width_array: list[int] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = True
    return_encoder_output: bool = False
    return_perf_metrics: bool = False
    additional_model_outputs: list[str] | None = None
    lookahead_config: Any = None
    guided_decoding: GuidedDecodingParams | None = None
    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    _return_log_probs: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.best_of = self.best_of or self.n
        if self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) cannot be less than n ({self.n})")
        greedy = (
            all(v is None for v in (self.temperature, self.top_p, self.top_k))
            or self.top_k == 1
            or self.top_p == 0.0
            or self.temperature == 0
        )
        if (
            greedy
            and self.best_of > 1
            and not self.use_beam_search
            and os.environ.get("TLLM_ALLOW_N_GREEDY_DECODING") != "1"
        ):
            raise ValueError("Greedy decoding in the LLM API does not allow multiple returns")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.top_p is not None and not 0 <= self.top_p <= 1:
            raise ValueError("top_p must be in [0, 1]")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError("truncate_prompt_tokens must be >= 1")
        if self.guided_decoding is not None:
            self.guided_decoding._validate()
        if self.logprobs is not None:
            self.logprobs = int(self.logprobs)
