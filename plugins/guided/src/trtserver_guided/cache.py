"""A thread-safe LRU of compiled guides with per-key de-duplication and a compile deadline.

Each compile runs on its own daemon thread (so a compile never holds up the process's exit); how
many run at once is the backend's business (``worker.Lanes``). A hit returns at once, never
waiting for another key's compile. A caller waits at most ``timeout`` seconds and then gets
``InvalidRequest("guide compilation exceeded N s")``. Compiles that can run away are killed at
their deadline (``worker.run_in_worker``) or refused up front by their backend; an in-process
compile that outlives its caller still lands in the cache, so a client that retries the same
spec does not start a second compile.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Generic, TypeVar

from trtserver.errors import InvalidRequest

T = TypeVar("T")


class CompileCache(Generic[T]):
    def __init__(self, max_entries: int = 128, *, max_bytes: int | None = None,
                 size: Callable[[T], int] | None = None) -> None:
        """At most ``max_entries`` guides, and ``max_bytes`` of them as ``size`` measures them."""
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._size = size or (lambda _: 0)
        self.bytes = 0
        self._lock = threading.Lock()
        self._done: OrderedDict[Hashable, tuple[T, int]] = OrderedDict()
        self._pending: dict[Hashable, Future[T]] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._done)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._done

    def get(self, key: Hashable, compile_fn: Callable[[], T], timeout: float) -> T:
        with self._lock:
            if key in self._done:
                self._done.move_to_end(key)
                self.hits += 1
                return self._done[key][0]
            future = self._pending.get(key)
            fresh = future is None
            if future is None:
                self.misses += 1
                future = Future()
                self._pending[key] = future
        if fresh:  # outside the lock: a future that is already done runs the callback right here
            future.add_done_callback(functools.partial(self._finish, key))
            threading.Thread(target=_run, args=(future, compile_fn), name="guide-compile", daemon=True).start()
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            raise InvalidRequest(f"guide compilation exceeded {timeout:g} s") from None

    def _finish(self, key: Hashable, future: Future[T]) -> None:
        with self._lock:
            self._pending.pop(key, None)
            if future.cancelled() or future.exception() is not None:
                return  # errors are not cached: they are cheap to reproduce and may be transient
            value = future.result()
            size = self._size(value)
            if self.max_bytes is not None and size > self.max_bytes:
                return  # answered, not kept: it would push out everything else
            self._done[key] = (value, size)
            self.bytes += size
            while len(self._done) > self.max_entries or (self.max_bytes is not None and self.bytes > self.max_bytes):
                self.bytes -= self._done.popitem(last=False)[1][1]

    def fail_pending(self, exc: BaseException) -> None:
        """End the wait of every caller of a compile still running (the compile may go on)."""
        with self._lock:
            futures = list(self._pending.values())
        for future in futures:  # outside the lock: the done callback takes it
            try:
                future.set_exception(exc)
            except InvalidStateError:
                pass

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def clear(self) -> None:
        with self._lock:
            self._done.clear()
            self.bytes = 0


def _run(future: Future[T], compile_fn: Callable[[], T]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = compile_fn()
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting callers
        with contextlib.suppress(InvalidStateError):  # already failed by fail_pending
            future.set_exception(exc)
    else:
        with contextlib.suppress(InvalidStateError):
            future.set_result(result)
