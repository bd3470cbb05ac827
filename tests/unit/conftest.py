"""Unit tests are pure: no model directory (tests/engine and tests/http have the real model)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
MODEL_FIXTURES = frozenset({"engine_dir", "smol_dir"})  # tests/conftest.py and tests/engine/conftest.py


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if used and HERE in item.path.parents:
            raise pytest.UsageError(f"{item.nodeid} uses {', '.join(sorted(used))}: a unit test needs no model; "
                                    "move it to tests/engine or tests/http, or use trtserver.scripted_engine")
