"""Running the app: listen, wait for the engine, drain on SIGTERM, exit with a meaningful code."""

from __future__ import annotations

import asyncio
import signal
import sys

import structlog
from aiohttp import web

from trtserver.config import ServerConfig
from trtserver.server import STATE

log = structlog.get_logger("trtserver")


async def drain(app: web.Application, grace_s: float) -> None:
    """Refuse new requests (503) and give running ones up to ``grace_s`` to finish."""
    state = app[STATE]
    state.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while state.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if state.in_flight:
        log.warning("shutdown_grace_expired", in_flight=state.in_flight)


async def run_server(app: web.Application, config: ServerConfig) -> int:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    loop = asyncio.get_running_loop()
    print(f"trtserver listening on http://{config.host}:{config.port} "
          f"(event loop: {type(loop).__module__.split('.')[0]})", file=sys.stderr)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    engine_task = app[STATE].engine_task
    if engine_task is None:
        raise RuntimeError("the app's startup did not begin loading the engine")
    stop_task = asyncio.create_task(stop.wait())
    await asyncio.wait({engine_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if engine_task.done() and not engine_task.cancelled() and engine_task.exception() is not None:
        print(f"trtserver: the engine failed to load: {app[STATE].load_error}", file=sys.stderr)
        code = 1
    else:
        await stop_task
        log.info("shutting_down", grace_s=config.shutdown_grace_s)
        await drain(app, config.shutdown_grace_s)
    stop_task.cancel()
    await runner.cleanup()
    return code
