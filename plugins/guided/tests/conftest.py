"""Fixtures: the real SmolLM2 tokenizer (engines/SmolLM2-135M-Instruct, or $TRTSERVER_TEST_ENGINE_DIR)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from trtserver.guided import GuideContext
from trtserver.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[3]
ENGINE_DIR = Path(os.environ.get("TRTSERVER_TEST_ENGINE_DIR", REPO / "engines" / "SmolLM2-135M-Instruct"))
BACKENDS = ("xgrammar", "llguidance", "outlines", "lm-format-enforcer")
PAD = 64  # logits wider than the tokenizer, as padded lm_heads are


@pytest.fixture(scope="session")
def engine_dir() -> Path:
    if not (ENGINE_DIR / "tokenizer.json").exists():
        pytest.skip(f"{ENGINE_DIR} is missing: run `make engines` first")
    return ENGINE_DIR


@pytest.fixture(scope="session")
def tokenizer(engine_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(engine_dir)


@pytest.fixture(scope="session")
def context(tokenizer: Tokenizer) -> GuideContext:
    return GuideContext(tokenizer=tokenizer, vocab_size=tokenizer.vocab_size + PAD,
                        eos_token_ids=tokenizer.eos_token_ids, compile_timeout_s=60.0)
