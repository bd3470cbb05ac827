"""Regenerate the hook reference in ``docs/plugins.md`` from ``trtserver/hookspecs.py``.

The docstrings in ``hookspecs.py`` are the source of truth; this script copies them, with each
hook's exact signature ``name(arg1, arg2)``, between ``<!-- hooks:start -->`` and
``<!-- hooks:end -->``, and the per-step Protocols between ``<!-- protocols:start -->`` and
``<!-- protocols:end -->``.

    python docs/gen_hooks.py          # rewrite docs/plugins.md
    python docs/gen_hooks.py --check  # exit 1 if it is out of date (what the tests check)
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent / "plugins.md"
PROTOCOLS = (("trtserver.engine.base", "TokenConstraint"), ("trtserver.engine.base", "GuidedDecoder"),
             ("trtserver.engine.base", "LogitsProcessor"), ("trtserver.text", "StopChecker"))


def hook_signature(name: str) -> str:
    from trtserver.plugins import new_plugin_manager

    spec = getattr(new_plugin_manager().hook, name).spec
    return f"{name}({', '.join(spec.argnames)})"


def hooks_section() -> str:
    from trtserver import hookspecs
    from trtserver.plugins import new_plugin_manager

    pm = new_plugin_manager()
    names = [n for n, f in vars(hookspecs).items() if n.startswith("trtserver_") and inspect.isfunction(f)]
    parts = []
    for name in names:
        caller = getattr(pm.hook, name)
        options = caller.spec.opts
        flags = [flag for flag in ("firstresult", "historic") if options.get(flag)]
        heading = f"### `{hook_signature(name)}`"
        if flags:
            heading += " (" + ", ".join(flags) + ")"
        doc = inspect.cleandoc(caller.spec.function.__doc__ or "")
        parts.append(f"{heading}\n\n{doc}\n")
    return "\n".join(parts)


def protocols_section() -> str:
    import importlib

    parts = []
    for module_name, class_name in PROTOCOLS:
        cls = getattr(importlib.import_module(module_name), class_name)
        lines = [f"### `{module_name}.{class_name}`", "", inspect.cleandoc(cls.__doc__ or ""), ""]
        for method_name, method in vars(cls).items():
            if not inspect.isfunction(method) or (method_name.startswith("_") and method_name != "__call__"):
                continue
            signature = str(inspect.signature(method)).replace("'", "")
            lines.append(f"- `{method_name}{signature}`" + (f": {inspect.getdoc(method)}" if method.__doc__ else ""))
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def _replace(text: str, marker: str, body: str) -> str:
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"{DOC}: markers {start} / {end} are missing")
    return pattern.sub(lambda _: f"{start}\n\n{body}\n{end}", text)


def render(text: str) -> str:
    return _replace(_replace(text, "hooks", hooks_section()), "protocols", protocols_section())


def main(argv: list[str]) -> int:
    current = DOC.read_text()
    wanted = render(current)
    if "--check" in argv:
        if wanted != current:
            print(f"{DOC} is out of date: run python docs/gen_hooks.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
