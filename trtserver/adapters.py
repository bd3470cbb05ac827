"""LoRA adapters on disk: which names a request may ask for, and what each adapter declares.

``--adapters-dir DIR`` holds one PEFT LoRA adapter per subfolder (what ``PeftModel.save_pretrained``
writes: ``adapter_config.json`` and ``adapter_model.safetensors``). A request's ``peft`` field names
a subfolder. Names are checked before the file system is touched: no separators, no ``..``, no
absolute paths, nothing hidden; and the folder's real path (symlinks resolved), and those of the two
files in it, must stay inside the real adapters directory. Unknown names are 404, everything else
wrong is 400 (``param="peft"``). No torch here: engines load the tensors themselves.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from trtserver.errors import InvalidRequest, NotFound

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_NAME_LENGTH = 255

# the projections LoRA may target: what a Llama-family block has (PEFT's module names)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """What the engine needs from ``adapter_config.json``."""

    name: str
    path: Path  # the adapter's folder (real path)
    weights: Path  # adapter_model.safetensors (real path)
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    @property
    def scale(self) -> float:
        """PEFT's scaling: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


class AdapterRegistry:
    """The adapters directory; ``resolve`` and ``load_config`` raise the client's errors."""

    def __init__(self, adapters_dir: str | os.PathLike[str], *, max_rank: int = 64) -> None:
        self.root = Path(adapters_dir)
        if not self.root.is_dir():
            raise FileNotFoundError(f"adapters directory {self.root} does not exist")
        self.real_root = self.root.resolve(strict=True)
        self.max_rank = max_rank

    def names(self) -> list[str]:
        """Subfolders that look like adapters (have an adapter_config.json), sorted."""
        out = []
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith(".") or not entry.is_dir():
                continue
            try:
                self.resolve(entry.name)
            except (InvalidRequest, NotFound):
                continue
            if (entry / CONFIG_FILE).is_file():
                out.append(entry.name)
        return out

    def resolve(self, name: str) -> Path:
        """The adapter's folder (real path): 400 for a name that is not a plain folder name or that
        leads outside the directory, 404 for one that is not there."""
        check_name(name)
        candidate = self.root / name
        if not candidate.exists() and not candidate.is_symlink():
            raise NotFound(f"The adapter `{name}` does not exist.", param="peft", code="adapter_not_found")
        real = self._inside(candidate, name)
        if not real.is_dir():
            raise NotFound(f"The adapter `{name}` does not exist.", param="peft", code="adapter_not_found")
        return real

    def load_config(self, name: str) -> AdapterConfig:
        """Resolve ``name`` and read its adapter_config.json; 400 for what this server cannot serve."""
        folder = self.resolve(name)
        config_path = folder / CONFIG_FILE
        if not config_path.is_file():
            raise NotFound(f"The adapter `{name}` has no {CONFIG_FILE}.", param="peft", code="adapter_not_found")
        self._inside(config_path, name)
        try:
            raw = json.loads(config_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidRequest(f"adapter `{name}`: {CONFIG_FILE} is not valid JSON ({exc})", param="peft") from exc
        if not isinstance(raw, dict):
            raise InvalidRequest(f"adapter `{name}`: {CONFIG_FILE} is not a JSON object", param="peft")
        config = parse_config(name, folder, raw, self.max_rank)
        weights = folder / WEIGHTS_FILE
        if not weights.is_file():
            if (folder / "adapter_model.bin").exists():
                raise InvalidRequest(f"adapter `{name}` has only adapter_model.bin (pickled PyTorch weights, which "
                                     "this server does not load); convert it to adapter_model.safetensors, e.g. "
                                     "load it with peft and save_pretrained(..., safe_serialization=True)",
                                     param="peft")
            raise InvalidRequest(f"adapter `{name}` has no {WEIGHTS_FILE}", param="peft")
        real_weights = self._inside(weights, name)
        return AdapterConfig(config.name, config.path, real_weights, config.r, config.lora_alpha,
                             config.target_modules, config.use_rslora)

    def _inside(self, path: Path, name: str) -> Path:
        real = path.resolve(strict=False)
        if real == self.real_root or not real.is_relative_to(self.real_root):
            raise InvalidRequest(f"adapter `{name}` leads outside the adapters directory", param="peft")
        return real


def check_name(name: object) -> None:
    """A plain folder name, or 400: no separators, ``..``, absolute paths, NUL or leading dot."""
    if not isinstance(name, str) or not name:
        raise InvalidRequest("peft must be a non-empty adapter name", param="peft")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidRequest(f"peft must be at most {MAX_NAME_LENGTH} characters", param="peft")
    if "\x00" in name:
        raise InvalidRequest("peft must not contain NUL characters", param="peft")
    if "/" in name or "\\" in name or ".." in name or name.startswith(".") or os.path.isabs(name) \
            or (len(name) > 1 and name[1] == ":"):
        raise InvalidRequest(f"peft {name!r} is not an adapter name: use the name of a folder in the adapters "
                             "directory (no '/', '\\', '..', leading '.' or absolute paths)", param="peft")


def parse_config(name: str, folder: Path, raw: dict[str, object], max_rank: int) -> AdapterConfig:
    """Check a PEFT config dict for what the engines support (plain LoRA on the block's projections)."""

    def bad(reason: str) -> InvalidRequest:
        return InvalidRequest(f"adapter `{name}`: {reason}", param="peft")

    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise bad(f"peft_type {peft_type} is not supported (only LORA)")
    r = raw.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise bad(f"r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise bad(f"rank r={r} is above this server's max_lora_rank ({max_rank})")
    alpha = raw.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise bad(f"lora_alpha must be a number, got {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise bad(f"{key} is not supported (one rank and alpha for every module)")
    if raw.get("use_dora"):
        raise bad("DoRA (use_dora) is not supported")
    if raw.get("bias", "none") not in ("none", None):
        raise bad(f"bias={raw.get('bias')!r} is not supported (only 'none')")
    for key, what in (("lora_bias", "LoRA bias terms"), ("layer_replication", "layer_replication"),
                      ("target_parameters", "target_parameters"), ("trainable_token_indices", "trainable tokens"),
                      ("use_qalora", "QA-LoRA"), ("use_bdlora", "block-diagonal LoRA")):
        if raw.get(key):
            raise bad(f"{what} ({key}) is not supported")
    if raw.get("modules_to_save"):
        raise bad("modules_to_save is not supported (the adapter may only hold LoRA matrices)")
    targets = raw.get("target_modules") or ()
    if isinstance(targets, str):
        # a regex or "all-linear": the weights file says which modules it really touches
        target_modules: tuple[str, ...] = (targets,)
    elif isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        unknown = sorted(t for t in targets if t.rsplit(".", 1)[-1] not in TARGETS)
        if unknown:
            raise bad(f"target_modules {unknown} are not supported (only {', '.join(TARGETS)})")
        target_modules = tuple(targets)
    else:
        raise bad(f"target_modules must be a list of names, got {targets!r}")
    return AdapterConfig(name, folder, folder / WEIGHTS_FILE, r, float(alpha), target_modules,
                         bool(raw.get("use_rslora", False)))
