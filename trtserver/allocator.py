"""The server process's policy for glibc's allocator: large blocks go back to the system when freed."""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h
LARGE_BLOCK_BYTES = 256 * 1024


def return_large_blocks(threshold: int = LARGE_BLOCK_BYTES) -> bool:
    """Give blocks of ``threshold`` bytes or more pages of their own, unmapped when freed. glibc otherwise
    raises its threshold to the largest block freed so far, and from then on such blocks come from the heap,
    where small live objects between them keep their memory with the process: each compiled guide or long
    prompt left the server's RSS at its high-water mark. False where the C library is not glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False
