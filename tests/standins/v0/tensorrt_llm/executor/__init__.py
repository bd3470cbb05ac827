"""executor.LoRARequest (ref §4.1) and RequestError."""

from __future__ import annotations

import os
from dataclasses import dataclass


class RequestError(RuntimeError):
    pass


@dataclass(slots=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not os.path.exists(self.lora_path):
            raise ValueError(f"lora_path ({self.lora_path}) does not exist.")
