"""The bridge between asyncio and the one worker thread that owns the model.

The event loop never waits on the model: ``submit`` and ``abort`` put commands on a thread-safe
queue and wake the worker. The worker runs ``EngineCore.step()`` while there is work and sleeps
on an event when there is none; after each step it hands all of that step's deltas to the loop
with ONE ``call_soon_threadsafe``, which pushes each into its request's mailbox.
Each request remembers the loop it was submitted from, so one engine can serve several loops
(tests do); with one loop, as in the server, a step costs exactly one cross-thread call.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from trtserver.engine.base import EngineStats, GenerationRequest, SequenceOutput
from trtserver.errors import EngineError

if TYPE_CHECKING:  # the server's side of an engine process imports this module, and no torch
    from trtserver.engine.torch.core import EngineCore
    from trtserver.engine.torch.transport.messages import Ready

_Command = tuple[str, object, object]


class Mailbox:
    """One request's deltas, in order, for the one task that reads them: what ``asyncio.Queue`` does,
    without its size bound, task counting and putters (five times the Python calls per item, once
    per streamed token)."""

    __slots__ = ("items", "_waiter")

    def __init__(self) -> None:
        self.items: deque[SequenceOutput | BaseException] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: SequenceOutput | BaseException) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # a cancelled reader left it behind
                waiter.set_result(None)

    async def get(self) -> SequenceOutput | BaseException:
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self.items.popleft()


class RequestStreams:
    """The event-loop side of an engine worker (a thread here, a process in ``process.py``): one
    ``Mailbox`` per running request, fed by ``_dispatch`` with each step's deltas."""

    threads_bound = False  # the worker's threads bound one per CPU (the engine process may be)
    failure: str | None = None  # why the worker died under the server, if it did
    report: Ready | None = None  # what a worker in another process settled (device, dtype, quantization)
    stats: EngineStats  # the worker's latest numbers

    def __init__(self) -> None:
        self._boxes: dict[str, Mailbox] = {}

    async def generate(self, request: GenerationRequest, num_outputs: int) -> AsyncIterator[SequenceOutput]:
        rid = request.request_id
        if rid in self._boxes:
            raise ValueError(f"request id {rid!r} is already running")
        box = Mailbox()
        self._submit(request, box)
        finished = False
        try:
            while num_outputs:
                item = box.items.popleft() if box.items else await box.get()
                if isinstance(item, BaseException):
                    finished = True  # the worker already dropped the request
                    raise item
                if item.finish_reason is not None:
                    num_outputs -= 1
                yield item
            finished = True
        finally:
            self._forget(rid)
            if not finished:
                self.abort(rid)

    def _submit(self, request: GenerationRequest, box: Mailbox) -> None:
        """Register ``box`` under the request's id and send the request to the worker (or raise)."""
        raise NotImplementedError

    def _forget(self, rid: str) -> None:
        self._boxes.pop(rid, None)

    def abort(self, request_id: str, index: int | None = None) -> None:
        raise NotImplementedError

    def _dispatch(self, outputs: list[SequenceOutput], errors: list[tuple[str, BaseException]]) -> None:
        boxes = self._boxes
        for out in outputs:
            box = boxes.get(out.request_id)
            if box is not None:
                box.put(out)
        for rid, exc in errors:
            box = boxes.get(rid)
            if box is not None:
                box.put(exc)


class EngineThread(RequestStreams):
    """The model on one worker thread of this process (``--no-engine-process``)."""

    def __init__(self, core: EngineCore) -> None:
        super().__init__()
        self.core = core
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._loops: dict[str, asyncio.AbstractEventLoop] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        core.preparer.notify = self._wake.set  # a request prepared off the loop is ready

    @property
    def stats(self) -> EngineStats:  # type: ignore[override]  # read from the core, here in this process
        return self.core.stats()

    # ---- event-loop side -------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="trtserver-torch-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        for rid in list(self._boxes):
            self._post(self._loops[rid], self._dispatch, [], [(rid, EngineError("the engine shut down"))])

    def _submit(self, request: GenerationRequest, box: Mailbox) -> None:
        if self._stopping or self._thread is None:
            raise EngineError("the engine is not running")
        rid = request.request_id
        self._loops[rid] = asyncio.get_running_loop()
        self._boxes[rid] = box
        self._send(("add", request, None))

    def _forget(self, rid: str) -> None:
        self._boxes.pop(rid, None)
        self._loops.pop(rid, None)

    def abort(self, request_id: str, index: int | None = None) -> None:
        self._send(("abort", request_id, index))

    def _send(self, command: _Command) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- worker side -----------------------------------------------------------------------
    def _work(self) -> None:
        core = self.core
        while not self._stopping:
            errors = self._run_commands()
            outputs, failed = core.run_step()
            errors += failed
            if outputs or errors:
                self._hand_over(outputs, errors)
            if not core.has_work and not self._stopping:
                self._wake.wait()
                self._wake.clear()

    def _run_commands(self) -> list[tuple[str, BaseException]]:
        errors: list[tuple[str, BaseException]] = []
        while True:
            try:
                kind, a, b = self._commands.get_nowait()
            except queue.Empty:
                return errors
            if kind == "add":
                request = a
                assert isinstance(request, GenerationRequest)
                try:
                    self.core.submit(request, request.request_id)
                except Exception as exc:
                    errors.append((request.request_id, exc))
            else:
                self.core.abort(a, b)  # type: ignore[arg-type]

    def _hand_over(self, outputs: list[SequenceOutput], errors: list[tuple[str, BaseException]]) -> None:
        loops = self._loops
        targets = {loops.get(o.request_id) for o in outputs} | {loops.get(rid) for rid, _ in errors}
        targets.discard(None)  # requests whose consumer already left
        if len(targets) == 1:  # the usual case: one loop, one call for the whole step
            self._post(targets.pop(), self._dispatch, outputs, errors)  # type: ignore[arg-type]
            return
        for loop in targets:
            mine = [o for o in outputs if loops.get(o.request_id) is loop]
            failed = [(rid, exc) for rid, exc in errors if loops.get(rid) is loop]
            self._post(loop, self._dispatch, mine, failed)  # type: ignore[arg-type]

    @staticmethod
    def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: object) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass
