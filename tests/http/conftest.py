"""One real server for the HTTP tests: a subprocess on a free loopback port, or an already running
one named by ``TRTSERVER_TEST_BASE_URL`` (how ``make gpu-check`` points these tests at a GPU)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

MODEL = "SmolLM2-135M-Instruct"
# The servers these tests start themselves: on the CPU unless told otherwise, also on a GPU machine, where
# their timings (tokens that outlast a grace period, arrivals during a decode) and CPU pinning were set.
TEST_DEVICE = os.environ.get("TRTSERVER_TEST_DEVICE", "cpu")
# The device of the server TRTSERVER_TEST_BASE_URL names (bench/gpu_check.py sets it): a bfloat16 GPU
# rounds one row's logits differently in a batch of four (a step of 0.06 near a logit of 16).
BASE_DEVICE = os.environ.get("TRTSERVER_TEST_BASE_DEVICE", "cpu")
LOGPROB_TOLERANCE = 1e-3 if BASE_DEVICE == "cpu" else 0.1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(base: str, process: subprocess.Popen[bytes] | None, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("server did not become healthy")


def start_server(engine_dir: Path, *args: str, log_name: str = "server") -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with open(Path(os.environ.get("TMPDIR", "/tmp")) / f"trtserver-test-{log_name}-{port}.log", "wb") as log:
        process = subprocess.Popen(  # the server writes its own copy of the file descriptor
            [sys.executable, "-m", "trtserver.cli", "serve", str(engine_dir), "--port", str(port),
             "--engine", os.environ.get("TRTSERVER_TEST_ENGINE", "torch"), "--device", TEST_DEVICE, *args],
            stdout=log, stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, process)
    except Exception:
        process.kill()
        raise
    return process, base


def stop_server(process: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """SIGTERM (the server drains), then SIGKILL if it has not exited in ``timeout`` seconds."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()


SERVER_RSS = pytest.StashKey[tuple[tuple[float, float], tuple[float, float]]]()


def _rss_mib(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0) / 1024


def rss_mib(pid: int) -> tuple[float, float]:
    """Resident memory, in MiB, of the server process ``pid`` and of its children (the engine process)."""
    children: list[int] = []
    pids = [pid]
    while pids:
        try:
            found = [int(c) for c in Path(f"/proc/{pids[0]}/task/{pids[0]}/children").read_text().split()]
        except OSError:
            found = []
        pids = pids[1:] + found
        children += found
    return _rss_mib(pid), sum(_rss_mib(child) for child in children)


@pytest.fixture(scope="session")
def base_url(engine_dir: Path, pytestconfig: pytest.Config) -> Iterator[str]:
    external = os.environ.get("TRTSERVER_TEST_BASE_URL")
    if external:
        wait_healthy(external, None)
        yield external
        return
    process, base = start_server(engine_dir)
    at_start = rss_mib(process.pid)
    yield base
    pytestconfig.stash[SERVER_RSS] = (at_start, rss_mib(process.pid))
    stop_server(process)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if SERVER_RSS in config.stash:  # what the shared server holds after every test used it
        (server_start, engine_start), (server_end, engine_end) = config.stash[SERVER_RSS]
        terminalreporter.write_line(
            f"shared test server RSS: server process {server_start:.0f} MiB when ready, {server_end:.0f} MiB after "
            f"the tests; engine process {engine_start:.0f} -> {engine_end:.0f} MiB (its KV cache fills as positions "
            "are first written)")


@pytest.fixture(scope="session")
def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=120) as http_client:
        yield http_client
