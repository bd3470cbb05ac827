"""``--pin-threads``: the engine process's environment, and an operator's own OpenMP settings."""

from __future__ import annotations

from trtserver.engine.torch.transport.process import pinned_env


def test_threads_bound_one_per_cpu_by_default() -> None:
    env = pinned_env({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "OMP_PROC_BIND": "close", "OMP_PLACES": "threads"}


def test_an_operator_s_openmp_settings_win() -> None:
    assert pinned_env({"OMP_PROC_BIND": "false"}) == {"OMP_PROC_BIND": "false"}
    assert pinned_env({"OMP_PLACES": "{2},{3}"}) == {"OMP_PLACES": "{2},{3}"}


def test_the_event_loop_is_pinned_and_its_executor_is_not() -> None:
    """In a thread of its own (affinity is per thread), as ``trtserver serve`` does on its loop."""
    import asyncio
    import os
    import threading

    from trtserver.http.run import pin_event_loop

    cpus = os.sched_getaffinity(0)
    seen: dict[str, set[int]] = {}

    async def main() -> None:
        pin_event_loop(asyncio.get_running_loop())
        seen["loop"] = os.sched_getaffinity(0)
        seen["executor"] = await asyncio.to_thread(os.sched_getaffinity, 0)

    thread = threading.Thread(target=asyncio.run, args=(main(),))
    thread.start()
    thread.join(30)
    assert seen["loop"] == ({max(cpus)} if len(cpus) > 1 else cpus)
    assert seen["executor"] == cpus
    assert os.sched_getaffinity(0) == cpus  # this thread was left alone
