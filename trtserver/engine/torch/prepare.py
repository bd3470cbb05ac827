"""Requests made ready off the step loop.

What a request brings that may take long (its plugin objects rebuilt in the engine process, where
a guide is compiled again; a LoRA adapter read from disk; a guide's per-sequence state) is done on
a background thread. The step loop admits the request once it is ready and keeps decoding the
running streams meanwhile. Plain Python, no torch.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

WORKERS = 2  # one slow compile does not hold up the next request's adapter


class Preparer(Generic[T]):
    """Jobs (one per request) run on daemon threads, so a job that never ends cannot keep the
    process from exiting. ``submit``, ``abort`` and ``ready`` are called from the step loop only;
    ``notify`` (set by the loop's owner) is called from a worker thread when a job is done."""

    def __init__(self, workers: int = WORKERS) -> None:
        self.workers = workers
        self.notify: Callable[[], None] = _nothing
        self.pending: dict[str, list[int | None]] = {}  # request id -> aborts asked while preparing
        self._jobs: queue.SimpleQueue[tuple[str, Callable[[], T]]] = queue.SimpleQueue()
        self._done: deque[tuple[str, T | BaseException]] = deque()
        self._threads: list[threading.Thread] = []

    def submit(self, request_id: str, job: Callable[[], T]) -> None:
        if request_id in self.pending:
            raise ValueError(f"request id {request_id!r} is already running")
        if len(self._threads) < self.workers and len(self._threads) <= len(self.pending):
            thread = threading.Thread(target=self._work, name="trtserver-prepare", daemon=True)
            thread.start()
            self._threads.append(thread)
        self.pending[request_id] = []
        self._jobs.put((request_id, job))

    def abort(self, request_id: str, index: int | None) -> bool:
        """Remember an abort for a request still being prepared (applied once it is admitted)."""
        aborts = self.pending.get(request_id)
        if aborts is None:
            return False
        aborts.append(index)
        return True

    @property
    def has_ready(self) -> bool:
        return bool(self._done)

    def ready(self) -> list[tuple[str, T | BaseException, list[int | None]]]:
        """The jobs done since the last call: (request id, result or error, aborts asked meanwhile)."""
        out = []
        while self._done:
            rid, result = self._done.popleft()
            out.append((rid, result, self.pending.pop(rid, [])))
        return out

    def _work(self) -> None:
        while True:
            rid, job = self._jobs.get()
            result: T | BaseException
            try:
                result = job()
            except BaseException as exc:  # noqa: BLE001 - the request's error, reported by the loop
                result = exc
            self._done.append((rid, result))
            self.notify()


def _nothing() -> None:
    pass
