"""Run one guide compile in a subprocess under an address-space limit (see ``worker.py``).

Run as ``python -I _compile_worker.py``; reads a pickled request on stdin (``task`` names the
function below), writes ``pickle.dumps(("ok", result))``, ``("memory", message)`` or
``("error", message)`` on stdout. The memory limit is applied once the task's library is
imported, so a compile that explodes fails here (MemoryError or an aborted allocation) instead of
taking the server down. The process exits as soon as the server process is gone. Imports nothing
from trtserver.
"""

from __future__ import annotations

import copyreg
import os
import pickle
import resource
import sys
import threading
import time
from collections.abc import Callable
from typing import Any


def outlines_index(request: dict[str, Any]) -> Callable[[], Any]:
    """An outlines-core ``Index`` for a regex or a JSON schema."""
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema

    def run() -> Any:
        kind, value, ws = request["kind"], request["value"], request["whitespace_pattern"]
        if kind in ("json", "json_object"):
            regex = build_regex_from_schema(value, ws) if ws is not None else build_regex_from_schema(value)
        else:
            regex = value
        vocab = oc.Vocabulary(request["eos"], request["tokens"])
        return oc.Index(regex, vocab)

    return run


def interegular_fsms(request: dict[str, Any]) -> Callable[[], Any]:
    """interegular FSMs (what lm-format-enforcer's RegexParser builds) for each pattern."""
    import interegular
    from interegular import fsm

    # the "any other character" symbol is a singleton the receiving side compares by identity
    copyreg.pickle(fsm._AnythingElseCls, lambda _: "anything_else")

    def run() -> Any:
        return {pattern: interegular.parse_pattern(pattern).to_fsm() for pattern in request["patterns"]}

    return run


TASKS = {"outlines": outlines_index, "interegular": interegular_fsms}


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def main() -> int:
    request = pickle.loads(sys.stdin.buffer.read())
    threading.Thread(target=_exit_with_parent, args=(int(request["parent"]),), daemon=True).start()
    run = TASKS[request["task"]](request)
    out = sys.stdout.buffer
    limit = int(request["max_bytes"])
    if limit > 0:  # after the imports: the limit bounds the compile, not the interpreter
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        payload = pickle.dumps(("ok", run()))
    except MemoryError:
        payload = pickle.dumps(("memory", "out of memory"))
    except Exception as exc:  # noqa: BLE001 - the library's regex / schema errors
        payload = pickle.dumps(("error", f"{type(exc).__name__}: {exc}"))
    out.write(payload)
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
