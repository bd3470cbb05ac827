"""The server's allocator policy: large blocks freed go back to the system, however the heap is pinned."""

from __future__ import annotations

import subprocess
import sys

import pytest

# a large block freed first (glibc then raises its threshold to that size), then 200 blocks of 1 MiB, each
# followed by a small live object (above pymalloc's 512 bytes, so from glibc's heap) that pins it there
PROGRAM = """
import re, sys
from pathlib import Path
from trtserver.allocator import return_large_blocks
def rss_mib():
    return int(re.search(r"VmRSS:\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024
if sys.argv[1] == "policy":
    assert return_large_blocks()
first = bytearray(8 << 20)
del first
before = rss_mib()
blocks, pins = [], []
for _ in range(200):
    blocks.append(bytearray(1 << 20))
    pins.append(bytearray(1024))
del blocks
print(rss_mib() - before)
"""


def kept_mib(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True)
    return float(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator and /proc are Linux's")
def test_large_blocks_freed_leave_the_process_with_the_policy_only() -> None:
    assert kept_mib("default") > 100  # glibc's own policy keeps them: what the server's RSS showed
    assert kept_mib("policy") < 20
