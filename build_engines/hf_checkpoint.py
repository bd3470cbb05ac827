"""A local Hugging Face Llama-family checkpoint directory (Llama, Mistral, Qwen2, SmolLM)."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from build_engines.writer import write_json

if TYPE_CHECKING:
    import torch

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    pass


@dataclass(frozen=True)
class HfCheckpoint:
    path: Path
    config: dict[str, Any]
    weight_files: tuple[Path, ...]
    """Sorted by name; all ``*.safetensors`` or all ``*.bin``."""

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or [ARCHITECTURES[self.config["model_type"]]]
        return str(archs[0])

    @property
    def context_length(self) -> int:
        return int(self.config.get("max_position_embeddings") or 2048)

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))

    def stamp(self) -> list[list[Any]]:
        """Cheap identity of the inputs (name, size, mtime) for the up-to-date check; no hashing."""
        files = [*self.weight_files, *(self.path / n for n in ("config.json", *SIDE_FILES))]
        out: list[list[Any]] = []
        for f in files:
            if f.is_file():
                st = f.stat()
                out.append([f.name, st.st_size, st.st_mtime_ns])
        return out

    def sha256(self) -> str:
        """One sha256 over the weight files' contents, in sorted name order."""
        digest = hashlib.sha256()
        total = sum(f.stat().st_size for f in self.weight_files)
        with tqdm(total=total, unit="B", unit_scale=True, desc="sha256 weights", leave=False) as bar:
            for path in self.weight_files:
                with path.open("rb") as fh:
                    while chunk := fh.read(_CHUNK):
                        digest.update(chunk)
                        bar.update(len(chunk))
        return digest.hexdigest()

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, with ``lm_head.weight`` dropped when the embeddings are tied."""
        import torch
        from safetensors import safe_open

        for path in tqdm(self.weight_files, desc="read weights", unit="file"):
            if path.suffix == ".safetensors":
                with safe_open(str(path), framework="pt") as f:
                    items = [(k, f.get_tensor(k)) for k in f.keys()]  # noqa: SIM118 (safe_open is no dict)
            else:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                items = list(state.items())
            for name, tensor in items:
                if self.tie_word_embeddings and name == "lm_head.weight":
                    continue
                yield name, tensor

    def copy_side_files(self, dst: Path, dtype: str) -> None:
        config = dict(self.config)
        config["torch_dtype"] = dtype
        write_json(dst / "config.json", config)
        for name in SIDE_FILES:
            if (self.path / name).is_file():
                shutil.copy2(self.path / name, dst / name)


def _weight_files(path: Path) -> tuple[Path, ...]:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = sorted({path / str(f) for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index} names missing shard(s): {', '.join(missing)}")
            return tuple(files)
    safetensors = sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if safetensors:
        return tuple(safetensors)
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:
        return tuple(bins)
    raise CheckpointError(f"{path}: no weights (*.safetensors or pytorch_model*.bin)")


def inspect_checkpoint(path: str | Path) -> HfCheckpoint:
    """Validate a checkpoint directory; raise :class:`CheckpointError` saying what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{path}: no config.json; expected a Hugging Face checkpoint directory")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path}: invalid JSON: {exc}") from exc
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in ARCHITECTURES:
        raise CheckpointError(
            f"{config_path}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(f"{path}: no tokenizer.json (the server needs a Hugging Face fast tokenizer)")
    return HfCheckpoint(path=path, config=config, weight_files=_weight_files(path))
