"""The engine process: ``python -m trtserver.engine.torch.transport.worker FD``, started by ``process.py``.

It owns the model and runs ``EngineCore.run_step()`` in a plain loop on its main thread: take the
server's commands (add, abort, stop) between steps, send each step's deltas as one frame. It
blocks on the socket when there is no work, so an idle server costs no CPU, and it exits when
the server asks, when the socket closes, or when the server process dies.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import socket
import sys
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

from trtserver.engine.torch.transport import messages

if TYPE_CHECKING:
    from trtserver.engine.torch.core import EngineCore


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the server stops us
    _die_with_parent()
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None  # before OpenMP binds us
    conn = Connection(int(argv[0]))
    start = messages.command_decoder.decode(conn.recv_bytes())
    if not isinstance(start, messages.Start):
        conn.send_bytes(messages.encode(messages.Failed(f"expected the start message, got {type(start).__name__}")))
        return 1
    config, seed, quantize = start.config, start.seed, start.quantize

    from trtserver.logs import configure_logging

    configure_logging(config.log_format, config.log_level)
    from trtserver.engine.torch.engine import TorchEngine

    try:
        engine = TorchEngine(config, seed=seed, quantize=quantize)
        engine.load()
    except BaseException as exc:  # noqa: BLE001 - reported to the server, which fails its start-up
        conn.send_bytes(messages.encode(messages.Failed(f"{type(exc).__name__}: {exc}")))
        return 1
    assert engine.device is not None
    if engine.device.type != "cpu" and cpus is not None:  # bound for a CPU engine that turned out a GPU one
        os.sched_setaffinity(0, cpus)
    assert engine.dtype_name is not None and engine.core is not None
    conn.send_bytes(messages.encode(messages.Ready(engine.dtype_name, engine.quantize, engine.device.type)))
    try:
        serve(engine.core, engine.tokenizer, conn)
    except (EOFError, OSError):  # the server went away
        pass
    return 0


def serve(core: EngineCore, tokenizer: object, conn: Connection) -> None:
    """Requests with plugin objects are unpickled off this loop (``core.submit``): that is where a
    guide is compiled again. A prepared request wakes the loop through ``woken``."""
    woken, poke = socket.socketpair()
    woken.setblocking(False)
    poke.setblocking(False)
    core.preparer.notify = functools.partial(_poke, poke)
    while True:
        failed: list[tuple[str, BaseException]] = []
        if not core.has_work:
            wait([conn, woken])
            _drain(woken)
        while conn.poll(0):
            command = messages.command_decoder.decode(conn.recv_bytes())
            if isinstance(command, messages.Add):
                rid = command.request_id
                try:
                    if command.plain:
                        core.submit(messages.rebuild_request(command.blob, tokenizer), rid)
                    else:
                        core.submit(None, rid, functools.partial(messages.rebuild_request, command.blob, tokenizer))
                except Exception as exc:  # noqa: BLE001 - the request fails, the engine goes on
                    failed.append((rid, exc))
            elif isinstance(command, messages.Abort):
                core.abort(command.request_id, command.index)
            elif isinstance(command, messages.Stop):
                return
        outputs, step_failed = core.run_step()
        failed += step_failed
        if outputs or failed:
            conn.send_bytes(messages.encode_step(outputs, failed, core.stats()))


def _poke(sock: socket.socket) -> None:
    try:
        sock.send(b"\0")
    except BlockingIOError:  # already poked: the loop has not woken yet
        pass


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except BlockingIOError:
        pass


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux/glibc: EOF on the socket still ends us
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
