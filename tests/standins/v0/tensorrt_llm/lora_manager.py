from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoraConfig:
    lora_dir: list[str] = field(default_factory=list)
    max_lora_rank: int = 64
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    lora_target_modules: list[str] = field(default_factory=list)
