"""The PyTorch engine's model in a process of its own, seen from a real ``trtserver serve``: the worker
dying under the server, ``--no-engine-process``, and a plugin file's objects crossing to the worker."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import aiohttp

from tests.http.test_lifecycle import (
    LONG,
    SMALL,
    Server,
    assert_envelope,
    assert_serves,
    data_lines,
    get_json,
    wait_ready,
)


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(child) for child in text]
    return found


def assert_pinned(server_pid: int, worker_pid: int, *, pinned: bool) -> None:
    """``--pin-threads`` (the default): the engine's OpenMP threads bound one per CPU, the event loop
    (the server's main thread) on the last CPU; ``--no-pin-threads``: neither."""
    cpus = sorted(os.sched_getaffinity(0))
    environ = Path(f"/proc/{worker_pid}/environ").read_bytes().split(b"\0")
    assert (b"OMP_PROC_BIND=close" in environ) is pinned and (b"OMP_PLACES=threads" in environ) is pinned
    loop_cpus = os.sched_getaffinity(server_pid)
    assert loop_cpus == ({cpus[-1]} if pinned and len(cpus) > 1 else set(cpus))
    if pinned and len(cpus) > 1:  # the model's own thread is bound to the first CPU
        assert os.sched_getaffinity(worker_pid) == {cpus[0]}


async def test_engine_process_death_fails_the_stream_and_health(engine_dir: Path) -> None:
    server = Server(engine_dir, *SMALL)
    try:
        await wait_ready(server)
        (worker,) = children(server.process.pid)
        assert "trtserver.engine.torch.transport.worker" in Path(f"/proc/{worker}/cmdline").read_text()
        assert "(event loop: uvloop)" in server.log()  # the default where uvloop is installed
        assert_pinned(server.process.pid, worker, pinned=True)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http_client:
            response = await http_client.post(f"{server.base}/v1/completions", json={**LONG, "stream": True})
            assert response.status == 200
            lines = data_lines(response)
            assert json.loads(await anext(lines))["choices"][0]["finish_reason"] is None
            os.kill(worker, signal.SIGKILL)
            rest = [line async for line in lines]
            assert rest[-1] == "[DONE]"
            error = assert_envelope(json.loads(rest[-2]))
            assert error["code"] == "engine_error" and "exited" in str(error["message"])
            status, body = await get_json(http_client, f"{server.base}/health")
            assert status == 503 and body["status"] == "error" and "code -9" in str(body["error"])
            async with http_client.post(f"{server.base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}) as r:
                assert r.status == 500
                assert "not running" in str(assert_envelope(await r.json())["message"])
        assert server.process.poll() is None  # the server stays up to say what happened
    finally:
        server.stop()


async def test_no_engine_process_and_the_asyncio_loop(engine_dir: Path) -> None:
    server = Server(engine_dir, *SMALL, "--no-engine-process", "--event-loop", "asyncio")
    try:
        await wait_ready(server)
        assert children(server.process.pid) == []
        assert "(event loop: asyncio)" in server.log()
        await assert_serves(server.base)
    finally:
        server.stop()


FILE_PLUGIN = '''
import trtserver


class ForceToken:
    """Defined in a plugin file: the engine process cannot import it by name."""

    def __init__(self, token):
        self.token = token

    def __call__(self, output_token_ids, logits):
        keep = logits[self.token].item()
        logits.fill_(float("-inf"))
        logits[self.token] = keep


@trtserver.hookimpl
def trtserver_logits_processors(request, context, tokenizer):
    token = tokenizer.encode(" yes", add_special_tokens=False)[0]
    return [lambda: ForceToken(token)]
'''


async def test_a_plugin_file_s_processors_reach_the_engine_process(engine_dir: Path, tmp_path: Path) -> None:
    plugin = tmp_path / "force_yes.py"
    plugin.write_text(FILE_PLUGIN)
    server = Server(engine_dir, *SMALL, "--plugin", str(plugin), "--no-pin-threads")
    try:
        await wait_ready(server)
        (worker,) = children(server.process.pid)
        assert_pinned(server.process.pid, worker, pinned=False)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http_client:
            async with http_client.post(f"{server.base}/v1/completions",
                                    json={"prompt": "Say no", "max_tokens": 3, "temperature": 0}) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["choices"][0]["text"] == " yes yes yes"
    finally:
        server.stop()
