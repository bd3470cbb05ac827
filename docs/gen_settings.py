"""Regenerate the settings table in ``docs/settings.md`` from ``trtserver/config.py``.

Each ``ServerConfig`` field's ``Meta(description=...)`` is the one source: ``trtserver serve --help``
prints it and this script copies it, with the flag, TOML key, type and default, between
``<!-- settings:start -->`` and ``<!-- settings:end -->``.

    python docs/gen_settings.py          # rewrite docs/settings.md
    python docs/gen_settings.py --check  # exit 1 if it is out of date (what the tests check)
"""

from __future__ import annotations

import re
import sys
import typing
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parent / "settings.md"
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def type_text(kind: Any) -> str:
    """A field's type as a reader wants it: ``int ≥ 1``, ``auto | json``, ``list of str``, ``float > 0, optional``."""
    import msgspec

    bounds = []
    while typing.get_origin(kind) is typing.Annotated:
        for meta in typing.get_args(kind)[1:]:
            if isinstance(meta, msgspec.Meta):
                for name, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
                    bound = getattr(meta, name)
                    if bound is not None:  # 0 and 0.0 are one cached Annotated type: print whole numbers alike
                        bounds.append(f"{sign} {int(bound) if float(bound).is_integer() else bound}")
        kind = typing.get_args(kind)[0]
    args = typing.get_args(kind)
    origin = typing.get_origin(kind)
    if origin is typing.Literal:
        text = " \\| ".join(str(a) for a in args)
    elif origin is list:
        text = f"list of {type_text(args[0])}"
    elif origin is dict:
        text = "table"
    elif type(None) in args:
        text = type_text(next(a for a in args if a is not type(None))) + ", optional"
    else:
        text = getattr(kind, "__name__", str(kind))
    return text + (" " + ", ".join(bounds) if bounds else "")


def default_text(value: Any) -> str:
    import msgspec

    if value is msgspec.NODEFAULT:
        return "required"
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "—"
    if value in ([], {}):
        return "empty"
    return f"`{value}`"


def settings_table() -> str:
    import msgspec

    from trtserver.cli import settings
    from trtserver.config import ServerConfig

    fields = {f.name: f for f in msgspec.structs.fields(ServerConfig)}
    rows = ["| flag | TOML key | type | default | description |", "|---|---|---|---|---|"]
    for setting in settings():
        flag = setting.flag
        if flag is not None and setting.kind is bool:
            flag = f"{flag}, --no-{flag[2:]}"
        flag_text = f"`{flag}`" if flag else "(TOML only)"
        key = "(argument)" if setting.name == "engine_dir" else f"`{setting.name}`"
        description = setting.description.replace("|", "\\|")
        rows.append(f"| {flag_text} | {key} | {type_text(fields[setting.name].type)} | "
                    f"{default_text(setting.default)} | {description} |")
    return "\n".join(rows) + "\n"


def render(text: str) -> str:
    start, end = "<!-- settings:start -->", "<!-- settings:end -->"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"{DOC}: markers {start} / {end} are missing")
    return pattern.sub(lambda _: f"{start}\n\n{settings_table()}\n{end}", text)


def main(argv: list[str]) -> int:
    current = DOC.read_text()
    wanted = render(current)
    if "--check" in argv:
        if wanted != current:
            print(f"{DOC} is out of date: run python docs/gen_settings.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
