from __future__ import annotations

from pathlib import Path

import pytest

from trtserver.config import ServerConfig
from trtserver.engine.select import EngineSelectionError, build_engine, choose_engine_name, registered_engines
from trtserver.plugins import load_plugins, new_plugin_manager


def config(engine_dir: Path, engine: str) -> ServerConfig:  # selection reads no model: any directory will do
    return ServerConfig(engine_dir=str(engine_dir), engine=engine)


def test_auto_falls_back_to_torch_without_tensorrt_llm(tmp_path: Path) -> None:
    assert choose_engine_name(config(tmp_path, "auto")) == "torch"


def test_explicit_trtllm_says_why_it_cannot_run(tmp_path: Path) -> None:
    with pytest.raises(EngineSelectionError, match="TensorRT-LLM is not installed"):
        choose_engine_name(config(tmp_path, "trtllm"))


def test_unknown_engine_lists_the_registered_ones(tmp_path: Path) -> None:
    pm = new_plugin_manager()
    load_plugins(pm, allowlist=[])
    assert {"torch", "trtllm"} <= set(registered_engines(pm))
    with pytest.raises(EngineSelectionError, match="registered engines: .*torch"):
        build_engine(config(tmp_path, "bogus"), pm)
