"""Compile one outlines-core Index in a subprocess under an address-space limit.

Run as ``python -I _outlines_worker.py``; reads a pickled request on stdin, writes
``pickle.dumps(("ok", index))`` or ``("error", message)`` on stdout. The memory limit is applied
once outlines_core is imported, so a regex whose DFA explodes fails here (MemoryError or an
aborted allocation) instead of taking the server down. Imports nothing from trtserver.
"""

from __future__ import annotations

import pickle
import resource
import sys


def main() -> int:
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema

    request = pickle.loads(sys.stdin.buffer.read())
    out = sys.stdout.buffer
    limit = int(request["max_bytes"])
    if limit > 0:  # after the imports: the limit bounds the compile, not the interpreter
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        kind, value, ws = request["kind"], request["value"], request["whitespace_pattern"]
        if kind in ("json", "json_object"):
            regex = build_regex_from_schema(value, ws) if ws is not None else build_regex_from_schema(value)
        else:
            regex = value
        vocab = oc.Vocabulary(request["eos"], request["tokens"])
        index = oc.Index(regex, vocab)
        payload = pickle.dumps(("ok", index))
    except MemoryError:
        payload = pickle.dumps(("memory", "out of memory"))
    except Exception as exc:  # noqa: BLE001 - the library's regex / schema errors
        payload = pickle.dumps(("error", f"{type(exc).__name__}: {exc}"))
    out.write(payload)
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
