"""The static KV cache: ``num_slots`` sequences × ``max_len`` positions, allocated once."""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without touching their contents


class KVCache:
    """Per layer, K and V of shape ``(num_slots + 1, n_kv_heads, max_len + 1, head_dim)``.

    Slot ``num_slots`` and position ``max_len`` are scratch: padded rows of a batch write there
    and nothing ever reads them, so the hot path needs no bounds checks. Zero-filled, so stale
    positions beyond a sequence's live length are finite and vanish under the attention mask.

    On the CPU the zeros are an anonymous ``mmap``: untouched pages are the kernel's shared zero
    page, so the cache costs memory only for the positions sequences reach, and allocating it
    takes no time (``torch.zeros`` would write every byte). Not numpy's calloc: numpy asks for
    transparent huge pages, and one write would then cost 2 MB.
    """

    def __init__(self, n_layers: int, num_slots: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_slots + 1, n_kv_heads, max_len + 1, head_dim)
        self.k = [_zeros(shape, dtype, device) for _ in range(n_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(n_layers)]
        # one layer's worth of dense K and V, reused by every layer's decode attention (see ForwardContext.dense)
        on_cpu = torch.device(device).type == "cpu"
        self.dense = (_zeros((math.prod(shape),), dtype, device), _zeros((math.prod(shape),), dtype, device)) \
            if on_cpu else None
        self.num_slots = num_slots
        self.max_len = max_len
        self.scratch_slot = num_slots
        self.scratch_pos = max_len
        self.populated = [0] * num_slots  # positions of each slot that ``populate`` has faulted in
        self._can_populate = on_cpu

    def populate(self, slot: int, length: int) -> None:
        """Fault in the pages of ``slot``'s first ``length`` positions in every layer, leaving their contents
        as they are: on the CPU a first write to this memory costs microseconds a page, which a copy of a
        cached prefix into a fresh slot would otherwise pay while a request waits. Releases the GIL; a no-op
        off the CPU and on kernels without ``MADV_POPULATE_WRITE``."""
        if not self._can_populate or length <= self.populated[slot]:
            return
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        page = mmap.PAGESIZE
        for cache in (*self.k, *self.v):
            for head in cache[slot]:  # (positions, head_dim): contiguous
                start = head.data_ptr()
                end = start + min(length, head.shape[0]) * head.stride(0) * head.element_size()
                aligned = start - start % page
                if madvise(aligned, end - aligned, _MADV_POPULATE_WRITE) != 0:
                    self._can_populate = False  # an older kernel: the first writes fault the pages in
                    return
        self.populated[slot] = max(self.populated[slot], length)

    def copy_slot(self, src: int, dsts: list[int], length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into each slot of ``dsts``."""
        for cache in (*self.k, *self.v):
            for dst in dsts:  # a slice copy each: ~1.6x an indexed write's speed
                cache[dst, :, :length].copy_(cache[src, :, :length])

    def reorder(self, dsts: list[int], srcs: list[int], length: int) -> None:
        """Slot ``dsts[i]`` takes the contents of slot ``srcs[i]`` (a permutation is fine)."""
        moves = [(d, s) for d, s in zip(dsts, srcs) if d != s]
        if not moves:
            return
        dst = torch.tensor([d for d, _ in moves], device=self.k[0].device)
        src = torch.tensor([s for _, s in moves], device=self.k[0].device)
        for cache in (*self.k, *self.v):
            cache[dst, :, :length] = cache[src, :, :length]  # the read copies first, so overlaps are safe


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)  # the tensor keeps the map alive
