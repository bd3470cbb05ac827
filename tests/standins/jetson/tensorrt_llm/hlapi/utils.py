"""0.12 ``hlapi/utils.py`` SamplingParams (the 0.12.0 release is bracketed by main @be9cd719 and @74b324f6,
whose utils.py are identical): only ``max_new_tokens``, ``random_seed`` and ``min_length`` (``max_tokens`` /
``seed`` / ``min_tokens`` came in 0.13); ``beam_width`` (no n/best_of); ``return_log_probs`` (no
``logprobs: int``); ``stop_token_ids`` and ``embedding_bias`` are there; no guided_decoding, ignore_eos,
detokenize, min_p, finish_reason."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    end_id: int | None = None
    pad_id: int | None = None
    max_new_tokens: int = 32
    beam_width: int = 1
    top_k: int | None = None
    top_p: float | None = None
    top_p_min: float | None = None
    top_p_reset_ids: int | None = None
    top_p_decay: float | None = None
    random_seed: int | None = None
    temperature: float | None = None
    min_length: int | None = None
    beam_search_diversity_rate: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    length_penalty: float | None = None
    early_stopping: int | None = None
    no_repeat_ngram_size: int | None = None
    stop: Any = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    bad: Any = None
    bad_token_ids: list[int] | None = None
    embedding_bias: Any = None
    external_draft_tokens_config: Any = None
    prompt_tuning_config: Any = None
    lora_config: Any = None
    logits_post_processor_name: str | None = None
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = True
    return_encoder_output: bool = False
