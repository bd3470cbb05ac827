"""Prefix caching on TensorRT-LLM: KV-cache block reuse asked for through ``KvCacheConfig`` where the
version has the setting, and ``cached_tokens`` reported only where the version returns the count."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.standins import harness
from tests.standins.harness import make_engine, request
from trtserver.engine.base import SequenceOutput
from trtserver.engine.trtllm.version import class_fields, has_setting
from trtserver.hookspecs import hookimpl
from trtserver.http.state import STATE

standin = harness.standin

SYSTEM = [2, 3, 4, 5, 6, 7, 8, 9]  # two 4-token blocks shared by both prompts
FIRST = [*SYSTEM, 20, 21, 22]
SECOND = [*SYSTEM, 30, 31]


def set_version(version: str) -> None:
    setattr(sys.modules["tensorrt_llm"], "__version__", version)  # noqa: B010


def run_two(engine: Any, block: int = 4) -> tuple[list[SequenceOutput], list[SequenceOutput]]:
    """Two requests sharing the system prompt's blocks, one after the other."""

    async def go() -> tuple[list[SequenceOutput], list[SequenceOutput]]:
        await engine.start()
        if engine._llm.kv_blocks is not None:
            engine._llm.kv_blocks.tokens_per_block = block
        first = [d async for d in engine.generate(request("a", prompt=FIRST, max_tokens=2))]
        second = [d async for d in engine.generate(request("b", prompt=SECOND, max_tokens=2))]
        return first, second

    return asyncio.run(go())


def kv_config(engine: Any) -> Any:
    return engine._llm.kwargs.get("kv_cache_config")


def test_pytorch_backend_reuses_blocks_and_reports_cached_tokens(standin: Any, tmp_path: Path) -> None:
    engine = make_engine(standin, tmp_path, "v1", engine=False)
    assert engine.info.capabilities.prefix_caching
    first, second = run_two(engine)
    assert kv_config(engine).enable_block_reuse is True
    assert {d.num_cached_tokens for d in first} == {0}
    assert {d.num_cached_tokens for d in second} == {len(SYSTEM)}
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens == len(SYSTEM)
    assert stats.prefix_cache_miss_tokens == len(FIRST) + len(SECOND) - len(SYSTEM)


def test_a_prompt_never_reuses_its_last_token(standin: Any, tmp_path: Path) -> None:
    engine = make_engine(standin, tmp_path, "v1", engine=False)

    async def go() -> list[int]:
        await engine.start()
        engine._llm.kv_blocks.tokens_per_block = 4
        seen = []
        for rid in ("a", "b"):  # the same 8-token prompt twice: its second block holds the last token
            deltas = [d async for d in engine.generate(request(rid, prompt=SYSTEM, max_tokens=1))]
            seen.append(max(d.num_cached_tokens for d in deltas))
        return seen

    assert asyncio.run(go()) == [0, 4]


def test_no_prefix_cache_turns_block_reuse_off(standin: Any, tmp_path: Path) -> None:
    engine = make_engine(standin, tmp_path, "v1", engine=False, prefix_cache=False)
    assert not engine.info.capabilities.prefix_caching
    asyncio.run(engine.start())
    # 1.x's KvCacheConfig reuses blocks by default, so off is said explicitly
    assert kv_config(engine).enable_block_reuse is False and engine._llm.kv_blocks is None
    assert engine.stats().prefix_cache_hit_tokens == 0


def test_pytorch_backend_1_0_reuses_blocks_without_a_count(standin: Any, tmp_path: Path) -> None:
    engine = make_engine(standin, tmp_path, "v1", engine=False)
    set_version("1.0.0")
    assert not engine.info.capabilities.prefix_caching
    _, second = run_two(engine)
    assert kv_config(engine).enable_block_reuse is True
    assert {d.num_cached_tokens for d in second} == {0}
    assert engine.stats().prefix_cache_hit_tokens == 0


def test_tensorrt_engine_reuses_blocks_without_a_count(standin: Any, tmp_path: Path) -> None:
    engine = make_engine(standin, tmp_path, "v1")
    assert not engine.info.capabilities.prefix_caching
    _, second = run_two(engine)
    assert kv_config(engine).enable_block_reuse is True
    assert engine._llm.kv_blocks.blocks  # reuse happened in the executor; its C++ Result has no count
    assert {d.num_cached_tokens for d in second} == {0}


@pytest.mark.parametrize("generation", ["v0", "jetson"])
def test_older_versions_get_block_reuse_through_the_cpp_binding(
    standin: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, generation: str
) -> None:
    engine = make_engine(standin, tmp_path, generation, jetson=generation == "jetson", monkeypatch=monkeypatch)
    assert engine.features.block_reuse_setting and not engine.info.capabilities.prefix_caching
    asyncio.run(engine.start())
    config = engine._llm.args.kv_cache_config
    assert type(config).__name__ == "KvCacheConfigBinding" and config.enable_block_reuse is True
    off = make_engine(standin, tmp_path / "off", generation, jetson=generation == "jetson",
                      monkeypatch=monkeypatch, prefix_cache=False)
    asyncio.run(off.start())
    assert off._llm.args.kv_cache_config.enable_block_reuse is False


def test_engine_built_without_paged_context_attention_is_not_asked_to_reuse(
    standin: Any, tmp_path: Path
) -> None:
    engine = make_engine(standin, tmp_path, "v0", build={"plugin_config": {"use_paged_context_fmha": False}})
    assert engine.features.build.paged_context_fmha is False and not engine.features.block_reuse
    asyncio.run(engine.start())
    assert engine._llm.args.kv_cache_config.enable_block_reuse is False


def test_setting_probe_reads_bindings_dataclasses_and_models(standin: Any) -> None:
    standin("v0")
    from tensorrt_llm.llmapi import KvCacheConfig

    assert "enable_block_reuse" not in class_fields(KvCacheConfig)  # pybind11: no readable signature
    assert has_setting(KvCacheConfig, "enable_block_reuse") and not has_setting(KvCacheConfig, "reuse")
    with pytest.raises(TypeError):
        KvCacheConfig(reuse=True)
    standin("v1")
    from tensorrt_llm.llmapi import KvCacheConfig as ModelConfig

    assert has_setting(ModelConfig, "enable_block_reuse") and not has_setting(ModelConfig, "reuse")
    assert ModelConfig().enable_block_reuse is True
    with pytest.raises(ValueError):
        ModelConfig(reuse=True)


class StandinEngines:
    """Registers the TensorRT-LLM engine under another name: ``--engine trtllm`` asks for a GPU."""

    @hookimpl
    def trtserver_register_engines(self, register: Any) -> None:
        from trtserver.engine.trtllm import TrtllmEngine

        register("trtllm-standin", TrtllmEngine)


async def test_usage_reports_cached_prompt_tokens(
    standin: Any, tmp_path: Path, trtserver_client_factory: Any
) -> None:
    standin("v1")
    root = harness.make_engine_dir(tmp_path / "e", trtllm_version=None)  # the PyTorch backend's checkpoint
    client = await trtserver_client_factory([StandinEngines()], engine="trtllm-standin", engine_dir=str(root),
                                            max_model_len=256, installed_plugins=False)
    client.app[STATE].engine._llm.kv_blocks.tokens_per_block = 4
    words = " ".join(f"w{t}" for t in SYSTEM)
    usages = []
    for tail in ("w20 w21 w22", "w30 w31"):
        response = await client.post("/v1/completions", json={"prompt": f"{words} {tail}", "max_tokens": 2})
        assert response.status == 200, await response.text()
        usages.append((await response.json())["usage"])
    assert usages[0]["prompt_tokens"] == len(FIRST) and usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == len(SYSTEM)
    metrics = await (await client.get("/metrics")).text()
    assert f"trtserver_prefix_cache_hit_tokens_total {float(len(SYSTEM))}" in metrics
