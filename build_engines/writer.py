"""Write an engine directory: weights in the chosen dtype, JSON side files, staged then swapped in."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

WEIGHTS_NAME = "model.safetensors"
DTYPES = ("float32", "bfloat16", "float16")
REQUIRED_FILES = ("config.json", WEIGHTS_NAME, "tokenizer.json")


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def write_weights(tensors: Iterable[tuple[str, Any]], path: Path, dtype: str) -> None:
    """Save (name, array) pairs as one safetensors file in ``dtype``.

    Values are numpy arrays or torch tensors. float32/float16 from numpy need no torch; bfloat16
    (numpy has none) and torch inputs go through torch.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    items = list(tensors)
    if dtype != "bfloat16" and all(isinstance(v, np.ndarray) for _, v in items):
        from safetensors.numpy import save_file as save_numpy

        np_dtype = np.float32 if dtype == "float32" else np.float16
        arrays = {
            name: np.ascontiguousarray(v.astype(np_dtype, copy=False))
            for name, v in tqdm(items, desc=f"cast {dtype}", unit="tensor", leave=False)
        }
        save_numpy(arrays, str(path), metadata={"format": "pt"})
        return
    import torch
    from safetensors.torch import save_file as save_torch

    torch_dtype = getattr(torch, dtype)
    tensors_out: dict[str, torch.Tensor] = {}
    for name, value in tqdm(items, desc=f"cast {dtype}", unit="tensor", leave=False):
        t = torch.from_numpy(value) if isinstance(value, np.ndarray) else value
        # clone: tied weights from a .bin share storage, which safetensors refuses
        tensors_out[name] = (
            t.to(torch_dtype).contiguous().clone() if t.is_floating_point() else t.contiguous()
        )
    save_torch(tensors_out, str(path), metadata={"format": "pt"})


def has_required_files(engine_dir: Path) -> bool:
    return all((engine_dir / name).is_file() for name in REQUIRED_FILES)


def _make_readable(root: Path) -> None:
    os.chmod(root, 0o755)
    for path in root.rglob("*"):
        if not path.is_symlink():
            os.chmod(path, 0o755 if path.is_dir() else path.stat().st_mode | 0o644)


@contextlib.contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """Yield an empty staging directory next to ``final``; on success swap it into place.

    An interrupted or failed build leaves no half directory under the final name (only a hidden
    ``.<name>.tmp-*`` sibling, removed on failure); the old directory stays until the new one is complete.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield staging
        _make_readable(staging)  # mkdtemp makes it 0700, safetensors writes 0600
        old: Path | None = None
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, old / final.name)
        os.replace(staging, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
