from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ENGINE_DIR = REPO / "engines" / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def engine_dir() -> Path:
    if not (ENGINE_DIR / "trtserver.json").exists():
        pytest.fail(f"{ENGINE_DIR} is missing: run `make engines` first")
    return ENGINE_DIR
