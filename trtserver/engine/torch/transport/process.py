"""The model in a process of its own (``--engine-process``, the server's default on the PyTorch engine).

Why: on a thread, the model's Python (hundreds of ATen calls per decode step, each releasing and
retaking the GIL) and the server's Python (HTTP, detokenizing, SSE) share one GIL, and every
hand-over of that lock costs a context switch and stalls the other side. As two processes they run
side by side on two cores, as vLLM's engine core does (figures in docs/perf-decisions.md).

``EngineProcess`` is the server's side: it starts ``worker.py`` with one end of a socket pair,
writes commands as frames (``messages.py``) and reads each step's deltas as one frame through an
asyncio protocol, with no thread of its own. If the engine process dies, every running request
fails with a 500 and ``failure`` says why (``/health`` then answers 503).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Mapping

from trtserver.config import ServerConfig
from trtserver.engine.base import EngineStats, GenerationRequest
from trtserver.engine.torch.transport import messages
from trtserver.engine.torch.transport.thread import Mailbox, RequestStreams
from trtserver.errors import EngineError


class EngineProcess(RequestStreams):
    def __init__(self, config: ServerConfig, *, seed: int | None, quantize: str | None, tokenizer: object) -> None:
        super().__init__()
        self._start = messages.Start(config, seed, quantize or "none")
        # the engine's threads bound one per CPU (pinned_env); `trtserver serve` then pins its event loop
        self.threads_bound = (config.pin_threads and config.device in ("auto", "cpu")
                              and hasattr(os, "sched_setaffinity"))
        self._tokenizer = tokenizer
        self._process: subprocess.Popen[bytes] | None = None
        self._transport: asyncio.Transport | None = None
        self.stats = EngineStats(slots_total=config.max_batch_size)
        self.report: messages.Ready | None = None  # what the engine process settled: device, dtype, quantization
        self.failure: str | None = None  # set when the engine process died under the server
        self._stopping = False

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def start(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "trtserver.engine.torch.transport.worker", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), close_fds=True,
                env=pinned_env(os.environ) if self.threads_bound else None)
        finally:
            theirs.close()
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[messages.Ready | messages.Failed] = loop.create_future()
        self._transport, _ = await loop.create_unix_connection(
            lambda: _Frames(self, ready), sock=ours)
        self._transport.write(messages.frame(self._start))
        answer = await ready
        if isinstance(answer, messages.Failed):
            await self._reap()
            raise EngineError(f"the engine process failed to start: {answer.reason}")
        self.report = answer

    async def stop(self) -> None:
        self._stopping = True
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(messages.frame(messages.Stop()))
        await self._reap()
        self._fail_all(EngineError("the engine shut down"))

    async def _reap(self) -> None:
        process = self._process
        if process is None:
            return
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.run_in_executor(None, process.wait), 10)
        except asyncio.TimeoutError:
            process.kill()
            await loop.run_in_executor(None, process.wait)
        if self._transport is not None:
            self._transport.close()
        self._process = None

    def _submit(self, request: GenerationRequest, box: Mailbox) -> None:
        if self.failure is not None:
            raise EngineError(f"the engine process is not running: {self.failure}")
        if self._transport is None or self._transport.is_closing():
            raise EngineError("the engine is not running")
        message = messages.encode_request(request, self._tokenizer)  # raises before anything is registered
        self._boxes[request.request_id] = box
        self._transport.write(messages.HEADER.pack(len(message)) + message)

    def abort(self, request_id: str, index: int | None = None) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(messages.frame(messages.Abort(request_id, index)))

    # ---- from the protocol -------------------------------------------------------------------
    def _on_step(self, payload: memoryview) -> None:
        outputs, failed, self.stats = messages.decode_step(payload)
        self._dispatch(outputs, failed)

    def _on_lost(self) -> None:
        process = self._process
        if process is not None and not self._stopping and self.failure is None:
            try:  # the socket closes as the process exits: its code follows within moments
                code: int | None = process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                code = None
            self.failure = "the engine process exited" + (f" (code {code})" if code is not None else "")
        self._fail_all(EngineError(self.failure or "the engine shut down"))

    def _fail_all(self, exc: EngineError) -> None:
        self._dispatch([], [(rid, exc) for rid in self._boxes])


def pinned_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The engine process's environment with its OpenMP threads bound one per CPU, in order, within
    the CPUs the server may use (``taskset``, cgroups): unbound, the event loop's wake-ups land on
    whichever thread is busy, the model's critical one too. An operator's own OMP_PROC_BIND /
    OMP_PLACES win."""
    env = dict(environ)
    if "OMP_PROC_BIND" not in env and "OMP_PLACES" not in env:
        env.update(OMP_PROC_BIND="close", OMP_PLACES="threads")
    return env


class _Frames(asyncio.Protocol):
    """Splits the engine's byte stream into frames."""

    def __init__(self, owner: EngineProcess, ready: asyncio.Future[messages.Ready | messages.Failed]) -> None:
        self.owner = owner
        self.ready = ready
        self.pending = bytearray()

    def data_received(self, data: bytes) -> None:
        if self.pending:
            self.pending += data
            data = bytes(self.pending)
            self.pending.clear()
        view, start, header = memoryview(data), 0, messages.HEADER.size
        while len(data) - start >= header:
            (size,) = messages.HEADER.unpack_from(data, start)
            if len(data) - start - header < size:
                break
            self._frame(view[start + header:start + header + size])
            start += header + size
        if start < len(data):
            self.pending += view[start:]

    def _frame(self, body: memoryview) -> None:
        if self.ready.done():  # once ready, the engine sends only steps
            self.owner._on_step(body)
        else:
            self.ready.set_result(messages.startup_decoder.decode(body))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ready.done():
            self.ready.set_result(messages.Failed(f"it exited before it was ready ({exc or 'socket closed'})"))
        self.owner._on_lost()
