"""0.16-era SamplingParams: the 1.2 list without what came later (per-request logits_processor 0.19,
``logprobs: int`` and prompt_logprobs 0.20, min_p 1.0, prompt_ignore_length, beam_width_array,
additional_model_outputs, the private _return_log_probs), with what went later (``return_log_probs``, and
``beam_width`` / ``num_return_sequences`` deprecated in 0.15); static ``logits_post_processor_name``.
GuidedDecodingParams (0.16)."""

from __future__ import annotations

import os
from dataclasses import dataclass
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
    logits_post_processor_name: str | None = None
    n: int = 1
    best_of: int | None = None
    beam_width: int | None = None
    num_return_sequences: int | None = None
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
    length_penalty: float | None = None
    early_stopping: int | None = None
    no_repeat_ngram_size: int | None = None
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = True
    return_encoder_output: bool = False
    return_perf_metrics: bool = False
    lookahead_config: Any = None
    guided_decoding: GuidedDecodingParams | None = None
    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

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
