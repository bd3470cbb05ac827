"""One real SmolLM2 PyTorch engine (float32, small cache, 16-token prefill chunks) for the module, and the fused
CPU kernels' ops."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trtserver.engine.torch.engine import TorchEngine

REPO = Path(__file__).resolve().parents[2]
ENGINE_DIR = REPO / "engines" / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    if not (ENGINE_DIR / "model.safetensors").exists() or not (ENGINE_DIR / "config.json").exists():
        pytest.fail(f"{ENGINE_DIR} is missing: run `make engines` first")
    return ENGINE_DIR


@pytest.fixture(scope="module")
def ops() -> object:
    """``torch.ops.trtserver``, the fused CPU kernels loaded (built first where they are not yet)."""
    from trtserver.engine.torch.cpu import kernels

    assert kernels.load(), "the fused kernels did not build (is a C++ compiler installed?)"
    return torch.ops.trtserver


@pytest.fixture(scope="session")
def engine(smol_dir: Path) -> Iterator[TorchEngine]:
    # chunk size 16 (the minimum) so prompts of the tests are prefilled in several chunks; one thread,
    # because two OpenMP threads stall on every barrier when other jobs share the two cores
    eng = TorchEngine.from_dir(smol_dir, dtype="float32", device="cpu", max_batch_size=8,
                               max_model_len=384, prefill_chunk_size=16, seed=0, threads=1)
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.shutdown())
