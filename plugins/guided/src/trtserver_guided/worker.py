"""Where compiles run: per-backend lanes that keep cheap compiles from queueing behind slow ones,
and a killable subprocess for the compiles that cannot be interrupted.

``Lanes`` (one per backend) admits at most ``fast`` compiles at a time. A compile still running
after ``slow_after_s`` moves to the slow lane (at most ``slow`` there), freeing its fast slot for
the next compile, and a worker process there runs at a lower CPU priority; when the slow lane is
full it keeps its fast slot. A slot is given back when the compile really ends, not when its
caller stops waiting, so the lanes also bound how many compiles burn CPU at once (``fast + slow``
per backend). Settings (environment): ``TRTSERVER_GUIDED_COMPILE_WORKERS`` (fast, default 2),
``TRTSERVER_GUIDED_SLOW_COMPILES`` (slow, default 4), ``TRTSERVER_GUIDED_SLOW_AFTER_S`` (default 1).

``run_in_worker`` runs one task of ``backends/_compile_worker.py`` in a fresh ``python -I``
process under an address-space limit and kills it at the deadline; the worker also exits when
the server process goes away, so nothing it started outlives the server. ``kill_all`` (the server's
shutdown) kills the workers running, and a compile asked for before it (``within``) starts none
after it: a compile thread still waiting for its lane would otherwise start a worker that runs to
its deadline after its caller has had its 503.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from trtserver.errors import InvalidRequest, Overloaded

WORKER = Path(__file__).with_name("backends") / "_compile_worker.py"
T = TypeVar("T")
_live: set[subprocess.Popen[bytes]] = set()
_live_lock = threading.Lock()
_kills = 0  # how many times kill_all has run (under _live_lock)
_asked = threading.local()  # a compile thread's kill count when its guide was asked for (within)


def kills() -> int:
    """How many times ``kill_all`` has run: what a guide asked for now passes to ``within``."""
    with _live_lock:
        return _kills


def within(asked: int, compile_fn: Callable[[], T]) -> T:
    """``compile_fn()``, on the compile's own thread, for a guide asked for when ``kills()`` was ``asked``: once
    ``kill_all`` has run since, the workers it would start are not started (``Overloaded``)."""
    _asked.count = asked
    try:
        return compile_fn()
    finally:
        del _asked.count


def kill_all() -> None:
    """Kill every compile worker process now (their callers get an error), and let no compile asked for
    before now start one."""
    global _kills
    with _live_lock:
        _kills += 1
        procs = list(_live)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()


def _env_int(name: str, default: int) -> int:
    return max(1, int(os.environ.get(name, str(default))))


def exceeded(timeout: float) -> InvalidRequest:
    return InvalidRequest(f"guide compilation exceeded {timeout:g} s")


class Lanes:
    def __init__(self, name: str, fast: int | None = None, slow: int | None = None,
                 slow_after_s: float | None = None) -> None:
        self.name = name
        self.fast = fast or _env_int("TRTSERVER_GUIDED_COMPILE_WORKERS", 2)
        self.slow = slow or _env_int("TRTSERVER_GUIDED_SLOW_COMPILES", 4)
        self.slow_after_s = slow_after_s if slow_after_s is not None else float(
            os.environ.get("TRTSERVER_GUIDED_SLOW_AFTER_S", "1"))
        self._fast = threading.BoundedSemaphore(self.fast)
        self._slow = threading.BoundedSemaphore(self.slow)

    def enter(self, deadline: float, timeout: float) -> Slot:
        if not self._fast.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise exceeded(timeout)
        return Slot(self)

    def run_here(self, fn: Callable[[], T], timeout: float) -> T:
        """Run ``fn`` in this thread (it cannot be killed) inside a lane."""
        slot = self.enter(time.monotonic() + timeout, timeout)
        timer = threading.Timer(self.slow_after_s, slot.promote)
        timer.daemon = True
        timer.start()
        try:
            return fn()
        finally:
            timer.cancel()
            slot.leave()


class Slot:
    """One running compile's place in its backend's lanes."""

    def __init__(self, lanes: Lanes) -> None:
        self._lanes = lanes
        self._lock = threading.Lock()
        self.lane: str | None = "fast"

    def promote(self) -> bool:
        """Move to the slow lane, freeing the fast slot; False when the slow lane is full."""
        with self._lock:
            if self.lane != "fast":
                return self.lane == "slow"
            if not self._lanes._slow.acquire(blocking=False):
                return False
            self.lane = "slow"
            self._lanes._fast.release()
            return True

    def leave(self) -> None:
        with self._lock:
            if self.lane == "fast":
                self._lanes._fast.release()
            elif self.lane == "slow":
                self._lanes._slow.release()
            self.lane = None


def run_in_worker(task: str, request: dict[str, Any], timeout: float, lanes: Lanes, max_mb: int) -> Any:
    """The result of ``task(request)`` computed in a killable subprocess; raises InvalidRequest (the
    task's error, the deadline or the memory limit)."""
    asked = getattr(_asked, "count", None)
    if asked is None:
        asked = kills()
    deadline = time.monotonic() + timeout
    slot = lanes.enter(deadline, timeout)
    try:
        _refuse_after_kill(asked)
        env = dict(os.environ, MALLOC_ARENA_MAX="2", RAYON_NUM_THREADS="2")
        message = pickle.dumps({"task": task, "parent": os.getpid(), "max_bytes": max_mb << 20, **request})
        proc = subprocess.Popen([sys.executable, "-I", str(WORKER)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        with _live_lock:
            _live.add(proc)
        try:
            _refuse_after_kill(asked)  # kill_all ran while it started: the finally below kills it
            out, err = _communicate(proc, message, deadline, lanes, slot, timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
            with _live_lock:
                _live.discard(proc)
    finally:
        slot.leave()
    if proc.returncode != 0 or not out:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        if "memory" in tail[0].lower() or proc.returncode < 0:
            raise InvalidRequest(f"{lanes.name} guide compilation exceeded the memory limit of {max_mb} MiB")
        raise InvalidRequest(f"{lanes.name} cannot compile this guide: {tail[0]}")
    status, payload = pickle.loads(out)
    if status == "memory":
        raise InvalidRequest(f"{lanes.name} guide compilation exceeded the memory limit of {max_mb} MiB")
    if status != "ok":
        raise InvalidRequest(f"{lanes.name} cannot compile this guide: {payload}")
    return payload


def _refuse_after_kill(asked: int) -> None:
    with _live_lock:
        if _kills != asked:
            raise Overloaded("the server is shutting down")


def _communicate(proc: subprocess.Popen[bytes], message: bytes, deadline: float, lanes: Lanes, slot: Slot,
                 timeout: float) -> tuple[bytes, bytes]:
    first = min(deadline, time.monotonic() + lanes.slow_after_s)
    try:
        return proc.communicate(message, timeout=max(0.01, first - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    if time.monotonic() < deadline and slot.promote():
        _lower_priority(proc.pid)
    try:
        return proc.communicate(timeout=max(0.01, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise exceeded(timeout) from None


def _lower_priority(pid: int) -> None:
    """A slow compile yields the CPU to the fast ones (nice is per thread on Linux: every thread)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 10)
        except OSError:
            pass
