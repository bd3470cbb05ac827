"""0.12 … 0.17-dev ``lora_manager.LoraConfig``: no ``max_loras`` / ``max_cpu_loras`` (those are LlmArgs fields)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoraConfig:
    lora_dir: list[str] = field(default_factory=list)
    lora_ckpt_source: str = "hf"
    max_lora_rank: int = 64
    lora_target_modules: list[str] = field(default_factory=list)
    trtllm_modules_to_hf_modules: dict[str, str] = field(default_factory=dict)
