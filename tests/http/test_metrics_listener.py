"""``/metrics`` on a listener of its own (``--metrics-port`` / ``--metrics-host``): a real server
process on the scripted engine, so no model is needed."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.http.conftest import free_port, start_server, stop_server
from trtserver.scripted_engine import write_engine_dir

PLUGIN = """\
from trtserver.scripted_engine import ScriptedEngines

_engines = ScriptedEngines()
trtserver_register_engines = _engines.trtserver_register_engines
"""


def scripted_server(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    plugin = tmp_path / "scripted_plugin.py"
    plugin.write_text(PLUGIN)
    engine_dir = write_engine_dir(tmp_path / "engine")
    return start_server(engine_dir, "--engine", "scripted", "--plugin", str(plugin), *args,
                        log_name="metrics-listener")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(main base URL, metrics base URL) of a server with API keys and a metrics key."""
    metrics_port = free_port()
    process, base = scripted_server(tmp_path_factory.mktemp("metrics"), "--metrics-port", str(metrics_port),
                                    "--metrics-host", "127.0.0.1", "--api-keys", "sk-app",
                                    "--metrics-api-keys", "sk-scrape")
    yield base, f"http://127.0.0.1:{metrics_port}"
    stop_server(process)


def test_metrics_are_served_on_their_own_port(servers: tuple[str, str]) -> None:
    base, metrics = servers
    done = httpx.post(f"{base}/v1/completions", json={"prompt": "hello there", "max_tokens": 3},
                      headers={"Authorization": "Bearer sk-app"}, timeout=30)
    assert done.status_code == 200
    scrape = httpx.get(f"{metrics}/metrics", headers={"Authorization": "Bearer sk-scrape"}, timeout=10)
    assert scrape.status_code == 200 and scrape.headers["Content-Type"].startswith("text/plain")
    counted = [line for line in scrape.text.splitlines()
               if line.startswith("trtserver_requests_total{") and 'status="200"' in line]
    assert counted and 'endpoint="completions"' in counted[0] and counted[0].endswith(" 1.0")
    assert "X-Request-Id" in scrape.headers


def test_the_metrics_key_still_guards_the_metrics_port(servers: tuple[str, str]) -> None:
    _, metrics = servers
    assert httpx.get(f"{metrics}/metrics", timeout=10).status_code == 401
    wrong = httpx.get(f"{metrics}/metrics", headers={"Authorization": "Bearer sk-app"}, timeout=10)
    assert wrong.status_code == 401


def test_the_main_port_answers_404_for_metrics(servers: tuple[str, str]) -> None:
    base, _ = servers
    for headers in ({}, {"Authorization": "Bearer sk-scrape"}, {"Authorization": "Bearer sk-app"}):
        response = httpx.get(f"{base}/metrics", headers=headers, timeout=10)
        assert response.status_code == 404, headers
        assert response.json()["error"]["code"] == "not_found"
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200


def test_the_metrics_port_serves_nothing_else(servers: tuple[str, str]) -> None:
    _, metrics = servers
    response = httpx.get(f"{metrics}/health", headers={"Authorization": "Bearer sk-app"}, timeout=10)
    assert response.status_code == 404


def test_metrics_port_equal_to_the_main_port_is_refused(tmp_path: Path) -> None:
    engine_dir = write_engine_dir(tmp_path / "engine")
    done = subprocess.run([sys.executable, "-m", "trtserver.cli", "serve", str(engine_dir), "--port", "8123",
                           "--metrics-port", "8123"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "metrics_port 8123 is the main port" in done.stderr


def test_metrics_host_without_a_port_is_refused(tmp_path: Path) -> None:
    engine_dir = write_engine_dir(tmp_path / "engine")
    done = subprocess.run([sys.executable, "-m", "trtserver.cli", "serve", str(engine_dir),
                           "--metrics-host", "10.0.0.1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "set metrics_port too" in done.stderr


def test_a_taken_metrics_port_stops_the_server_with_a_message(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        plugin = tmp_path / "scripted_plugin.py"
        plugin.write_text(PLUGIN)
        engine_dir = write_engine_dir(tmp_path / "engine")
        done = subprocess.run([sys.executable, "-m", "trtserver.cli", "serve", str(engine_dir), "--engine", "scripted",
                               "--plugin", str(plugin), "--port", str(free_port()), "--metrics-port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and f"cannot listen for /metrics on 127.0.0.1:{port}" in done.stderr


def test_without_metrics_port_the_main_port_serves_metrics(tmp_path: Path) -> None:
    process, base = scripted_server(tmp_path)
    try:
        assert httpx.get(f"{base}/metrics", timeout=10).status_code == 200
    finally:
        stop_server(process)
