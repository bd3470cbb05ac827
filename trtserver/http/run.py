"""Running the app: listen, wait for the engine, drain on SIGTERM, exit with a meaningful code."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

import structlog
from aiohttp import web

from trtserver.config import ServerConfig
from trtserver.engine.base import Engine
from trtserver.http.app import STATE, create_metrics_app, end_requests
from trtserver.http.connection import LINGERING_S, GuardedAppRunner

log = structlog.get_logger("trtserver")


async def drain(app: web.Application, grace_s: float) -> None:
    """Refuse new requests (503) and give running ones up to ``grace_s`` to finish; then cut off those
    still running (a stream ends with an error event and ``[DONE]``)."""
    state = app[STATE]
    state.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while state.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if state.in_flight:
        log.warning("shutdown_grace_expired", in_flight=state.in_flight)
    await end_requests(app)


def pin_event_loop(loop: asyncio.AbstractEventLoop) -> None:
    """``--pin-threads``, once the engine process runs with its threads bound one per CPU: this thread
    (the event loop) goes to the last CPU, beside the engine's last thread and never its first (the
    one that runs the model's Python between parallel regions). Threads and processes inherit the
    affinity of the thread that starts them, so the loop's default executor (``asyncio.to_thread``:
    guided-decoder compiles, and the pools and processes those start) gets the whole set back."""
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        return
    loop.set_default_executor(ThreadPoolExecutor(initializer=os.sched_setaffinity, initargs=(0, cpus)))
    try:
        os.sched_setaffinity(0, {max(cpus)})
    except OSError as exc:  # a sandbox that forbids it: serve unpinned
        log.warning("event_loop_not_pinned", error=str(exc))
        return
    log.info("event_loop_pinned", cpu=max(cpus))


def _pin_if_bound(engine: Engine) -> None:
    if engine.threads_bound:
        pin_event_loop(asyncio.get_running_loop())


def _runner(app: web.Application, config: ServerConfig) -> GuardedAppRunner:
    return GuardedAppRunner(app, header_timeout_s=config.header_timeout_s, handler_cancellation=True,
                            access_log=None, shutdown_timeout=1.0, keepalive_timeout=config.keepalive_timeout_s,
                            lingering_time=LINGERING_S)


async def start_metrics_listener(app: web.Application, config: ServerConfig) -> web.AppRunner | None:
    """``/metrics`` on ``metrics_host:metrics_port`` (an internal interface, say); None when unset."""
    if config.metrics_port is None:
        return None
    runner = _runner(create_metrics_app(app), config)
    await runner.setup()
    host = config.metrics_host or config.host
    try:
        await web.TCPSite(runner, host, config.metrics_port).start()
    except BaseException:
        await runner.cleanup()
        raise
    print(f"trtserver metrics on http://{host}:{config.metrics_port}/metrics", file=sys.stderr)
    return runner


async def run_server(app: web.Application, config: ServerConfig) -> int:
    app[STATE].engine_started = _pin_if_bound  # before it reports ready (the loading begins in setup)
    runner = _runner(app, config)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    try:
        metrics_runner = await start_metrics_listener(app, config)
    except OSError as exc:  # the port is taken, the address is not this machine's
        print(f"trtserver: cannot listen for /metrics on {config.metrics_host or config.host}:"
              f"{config.metrics_port}: {exc}", file=sys.stderr)
        await runner.cleanup()
        return 1
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
    if metrics_runner is not None:
        await metrics_runner.cleanup()
    await runner.cleanup()
    return code
