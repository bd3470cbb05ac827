"""≈0.12 ``hlapi/utils.py`` SamplingParams (ref §2, "0.12-era hlapi.SamplingParams"): both spellings of
max_tokens/seed/min_tokens, beam_width (no n/best_of), return_log_probs (no logprobs:int), static
logits_post_processor_name; no guided_decoding, ignore_eos, detokenize, min_p, embedding_bias,
stop_token_ids (the reference does not list them for 0.12: the narrower reading)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    max_new_tokens: int | None = None  # deprecated
    beam_width: int = 1
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    random_seed: int | None = None  # deprecated
    temperature: float | None = None
    min_tokens: int | None = None
    min_length: int | None = None  # deprecated
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    length_penalty: float | None = None
    early_stopping: int | None = None
    stop: Any = None
    include_stop_str_in_output: bool = False
    bad: Any = None
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = True
    logits_post_processor_name: str | None = None
    lora_config: Any = None
    prompt_tuning_config: Any = None
    external_draft_tokens_config: Any = None
