"""``--pin-threads``: the engine process's environment, and an operator's own OpenMP settings."""

from __future__ import annotations

from trtserver.engine.torch.process import pinned_env


def test_threads_bound_one_per_cpu_by_default() -> None:
    env = pinned_env({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "OMP_PROC_BIND": "close", "OMP_PLACES": "threads"}


def test_an_operator_s_openmp_settings_win() -> None:
    assert pinned_env({"OMP_PROC_BIND": "false"}) == {"OMP_PROC_BIND": "false"}
    assert pinned_env({"OMP_PLACES": "{2},{3}"}) == {"OMP_PLACES": "{2},{3}"}
