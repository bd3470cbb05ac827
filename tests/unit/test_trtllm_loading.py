"""/health answers "loading" while TensorRT-LLM builds its LLM (a stand-in whose load blocks for a while)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from tests.standins import harness
from trtserver.config import ServerConfig
from trtserver.hookspecs import hookimpl
from trtserver.http.app import create_app
from trtserver.plugins import load_plugins, new_plugin_manager

standin = harness.standin

LOAD_S = 1.5


class StandinEngine:
    """Registers the TensorRT-LLM engine under a name ``--engine auto`` never probes (no CUDA here)."""

    @hookimpl
    def trtserver_register_engines(self, register: Any) -> None:
        from trtserver.engine.trtllm import TrtllmEngine

        register("trtllm-standin", TrtllmEngine)


def test_health_says_loading_throughout_a_slow_load(standin: Any, tmp_path: Path) -> None:
    standin("v1")
    sys.modules["tensorrt_llm.llmapi.llm"].BaseLLM.load_seconds = LOAD_S
    root = harness.make_engine_dir(tmp_path / "e")
    pm = new_plugin_manager()
    load_plugins(pm, allowlist=[])
    pm.register(StandinEngine())
    app = create_app(ServerConfig(engine_dir=str(root), engine="trtllm-standin"), pm)

    async def poll() -> list[tuple[int, str, float]]:
        seen: list[tuple[int, str, float]] = []
        async with TestClient(TestServer(app)) as client:
            loop = asyncio.get_running_loop()
            start = loop.time()
            while loop.time() - start < 4 * LOAD_S:
                sent = loop.time()
                response = await client.get("/health")
                body = await response.json()
                seen.append((response.status, body["status"], loop.time() - sent))
                if body["status"] != "loading":
                    break
                await asyncio.sleep(0.05)
        return seen

    seen = asyncio.run(poll())
    loading = [s for s in seen if s[:2] == (503, "loading")]
    assert len(loading) >= 5, seen  # answered again and again during the load
    assert max(latency for *_, latency in loading) < LOAD_S / 2, seen  # never held up by it
    assert seen[-1][:2] == (200, "ok"), seen
