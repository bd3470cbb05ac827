"""What the server's processes ask of glibc's allocator: large blocks back to the system when freed, and
freed memory returned after a large one-off load."""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h
LARGE_BLOCK_BYTES = 256 * 1024


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def return_large_blocks(threshold: int = LARGE_BLOCK_BYTES) -> bool:
    """Give blocks of ``threshold`` bytes or more pages of their own, unmapped when freed. glibc otherwise
    raises its threshold to the largest block freed so far, and from then on such blocks come from the heap,
    where small live objects between them keep their memory with the process: each compiled guide or long
    prompt left the server's RSS at its high-water mark. False where the C library is not glibc."""
    libc = _libc()
    return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))


def release_freed_memory() -> None:
    """Return what the heap holds free to the system (``malloc_trim``); nothing where it is not glibc."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
