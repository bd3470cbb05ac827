"""py-spy profiles of a server under load, summarised by self and inclusive time."""

from __future__ import annotations

import re
import shutil
import sys
from collections import Counter
from pathlib import Path

from bench import peers


def py_spy() -> str | None:
    for cand in (peers.LLAMACPP_VENV / "bin" / "py-spy", Path(sys.executable).with_name("py-spy")):
        if cand.exists():
            return str(cand)
    return shutil.which("py-spy")


def summarize_profile(raw: Path, top: int = 14) -> str:
    """py-spy raw (collapsed) stacks -> the functions with most self time and most inclusive time."""
    self_c: Counter[str] = Counter()
    incl_c: Counter[str] = Counter()
    thread_c: Counter[str] = Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        thread_c[frames[0]] += n
        self_c[_short(frames[-1])] += n
        for f in {_short(f) for f in frames[1:]}:
            incl_c[f] += n
    if not total:
        return "(no samples)"
    lines = [f"{total} samples (all threads, idle included). By thread:"]
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in thread_c.most_common(6)]
    lines.append("Self time (leaf frame):")
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in self_c.most_common(top)]
    lines.append("Inclusive time:")
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in incl_c.most_common(top)]
    return "\n".join(lines)


def _short(frame: str) -> str:
    # "func (path/to/file.py:123)" -> "func (file.py:123)"; keep trtserver paths readable
    m = re.match(r"(.*) \((.*?):?(\d*)\)$", frame)
    if not m:
        return frame
    func, path, line = m.groups()
    p = Path(path)
    where = "/".join(p.parts[p.parts.index("trtserver"):]) if "trtserver" in p.parts else p.name
    return f"{func} ({where}:{line})" if line else f"{func} ({where})"
