from __future__ import annotations

import datetime as dt
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trtserver_prompt_log
from aiohttp.test_utils import TestClient
from trtserver_prompt_log import PromptLogSettings, delete_expired, settings_for

from trtserver.config import build_config
from trtserver.plugins import PluginConfigError
from trtserver.testing import serve

SETTINGS = {"engine": "torch", "max_batch_size": 4, "max_model_len": 512}


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("prompts")
    (directory / "prompts-2001-01-01.jsonl").write_text("{}\n")  # long expired: deleted at start-up
    (directory / "notes.txt").write_text("not ours")
    return directory


@pytest.fixture(scope="module")
async def client(log_dir: Path) -> AsyncIterator[TestClient[Any, Any]]:
    async with serve([trtserver_prompt_log], installed_plugins=False,
                     plugin_settings={"prompt_log": {"dir": str(log_dir)}}, **SETTINGS) as test_client:
        yield test_client


def records(log_dir: Path) -> list[dict[str, Any]]:
    paths = sorted(log_dir.glob("prompts-*.jsonl"))
    return [json.loads(line) for path in paths for line in path.read_text().splitlines()]


@pytest.mark.asyncio(loop_scope="session")
async def test_stored_only_when_asked(client: TestClient[Any, Any], log_dir: Path) -> None:
    assert not (log_dir / "prompts-2001-01-01.jsonl").exists() and (log_dir / "notes.txt").exists()
    response = await client.post("/v1/completions", json={"prompt": "secret one", "max_tokens": 2})
    assert response.status == 200
    assert records(log_dir) == []
    response = await client.post("/v1/completions", json={"prompt": "keep me", "max_tokens": 2, "log_prompt": True,
                                                           "user": "u-1"}, headers={"X-Request-Id": "rid-7"})
    assert response.status == 200
    (record,) = records(log_dir)
    assert record["prompt"] == "keep me" and record["user"] == "u-1" and record["request_id"] == "rid-7"
    assert set(record) == {"time", "request_id", "model", "prompt", "user"}
    today = dt.datetime.now(dt.timezone.utc).date()
    assert dt.datetime.fromisoformat(record["time"]).date() == today
    assert (log_dir / f"prompts-{today:%Y-%m-%d}.jsonl").exists()
    assert "secret one" not in "".join(p.read_text() for p in log_dir.iterdir())


@pytest.mark.asyncio(loop_scope="session")
async def test_write_is_off_the_event_loop(monkeypatch: pytest.MonkeyPatch, log_dir: Path) -> None:
    threads: list[str] = []
    original = trtserver_prompt_log.append_record

    def recording(*args: Any) -> None:
        threads.append(threading.current_thread().name)
        original(*args)

    monkeypatch.setattr(trtserver_prompt_log, "append_record", recording)

    class Request:
        log_prompt, model, prompt = True, None, [1, 2, 3]

    class Context:
        request_id, user, model = "r", None, "m"
        config = build_config({"engine_dir": ".", "plugins": {"prompt_log": {"dir": str(log_dir)}}})

    awaitable = trtserver_prompt_log.trtserver_request_received(Request(), Context())  # type: ignore[arg-type]
    assert awaitable is not None and not threads
    await awaitable
    assert threads and threads[0] != threading.current_thread().name
    assert records(log_dir)[-1]["prompt"] == [1, 2, 3]


@pytest.mark.asyncio(loop_scope="session")
async def test_400_when_not_configured(trtserver_scripted_client_factory) -> None:  # type: ignore[no-untyped-def]
    client = await trtserver_scripted_client_factory(plugins=[trtserver_prompt_log], plugin_allowlist=[])
    response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "log_prompt": True})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["message"] == "prompt logging is not enabled on this server" and error["param"] == "log_prompt"
    response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert response.status == 200


def test_retention(tmp_path: Path) -> None:
    today = dt.date(2025, 3, 31)
    for day in ("2025-03-31", "2025-03-01", "2025-02-28", "2024-12-01"):
        (tmp_path / f"prompts-{day}.jsonl").write_text("{}\n")
    (tmp_path / "prompts-latest.jsonl").write_text("{}\n")
    deleted = delete_expired(tmp_path, 30, today)
    assert sorted(p.name for p in deleted) == ["prompts-2024-12-01.jsonl", "prompts-2025-02-28.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts-2025-03-01.jsonl", "prompts-2025-03-31.jsonl",
                                                         "prompts-latest.jsonl"]


def test_settings_come_from_the_table() -> None:
    assert settings_for(build_config({"engine_dir": "."})) is None
    table: dict[str, object] = {"engine_dir": ".", "plugins": {"prompt_log": {"dir": "/p"}}}
    assert settings_for(build_config(table)) == PromptLogSettings(dir="/p", retention_days=30)
    table["plugins"] = {"prompt_log": {"dir": "/p", "retention_days": 7}}
    assert settings_for(build_config(table)) == PromptLogSettings(dir="/p", retention_days=7)


@pytest.mark.parametrize(("table", "named"), [
    ({"dir": "/p", "retention_days": -1}, "$.retention_days"),
    ({"dir": ""}, "$.dir"),
    ({"retention_days": 7}, "dir"),
    ({"dir": "/p", "retention": 7}, "retention"),
])
def test_bad_settings_name_the_plugin_and_the_setting(table: dict[str, object], named: str) -> None:
    with pytest.raises(PluginConfigError) as error:
        settings_for(build_config({"engine_dir": ".", "plugins": {"prompt_log": table}}))
    message = str(error.value)
    assert message.startswith("plugin 'prompt_log': invalid settings in [plugins.prompt_log]: ") and named in message


@pytest.mark.asyncio(loop_scope="session")
async def test_a_bad_table_stops_start_up(trtserver_scripted_client_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "prompts-2001-01-01.jsonl").write_text("{}\n")
    with pytest.raises(PluginConfigError, match=r"retention_days"):
        await trtserver_scripted_client_factory(plugins=[trtserver_prompt_log], plugin_allowlist=[], plugin_settings={
            "prompt_log": {"dir": str(tmp_path), "retention_days": -3}})
    assert (tmp_path / "prompts-2001-01-01.jsonl").exists()  # nothing deleted on a bad rule
