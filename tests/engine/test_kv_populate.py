"""Populating the KV cache ahead of a copied prefix (``KVCache.populate``, ``EngineCore._populate_ahead``): the
pages a new request's copy will write are faulted in beforehand, off the step."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from tests.engine.test_model_families import make_checkpoint
from trtserver.engine.base import GenerationRequest, SamplingParams
from trtserver.engine.torch.cache import KVCache
from trtserver.engine.torch.core import POPULATE_GRANULE, EngineCore
from trtserver.engine.torch.model import load_model


def _rss_mib() -> float:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) / 1024


def _can_populate() -> bool:
    """MADV_POPULATE_WRITE came with Linux 5.14."""
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())  # type: ignore[union-attr]
    return (major, minor) >= (5, 14)


def test_populate_faults_a_slot_in_and_leaves_its_contents() -> None:
    """``KVCache.populate`` makes a slot's first positions resident (the mmap's pages were the shared zero
    page) without changing what is there, and only once."""
    cache = KVCache(4, 3, 2, 4095, 64, torch.float32, torch.device("cpu"))  # 2 MiB a (slot, head) row
    cache.k[1][0, 1, :3] = 5.0  # slot 0 holds something
    before = _rss_mib()
    cache.populate(0, 1024)
    grew = _rss_mib() - before
    supported = _can_populate()
    assert cache.populated[0] == (1024 if supported else 0)
    if supported:  # 4 layers x (K, V) x 2 heads x 1024 positions x 64 x 4 bytes = 4 MiB
        assert 3.5 < grew < 6, grew
    assert (cache.k[1][0, 1, :3] == 5.0).all() and cache.k[1].count_nonzero() == 3 * 64
    assert all(t.count_nonzero() == 0 for t in (cache.k[0], *cache.k[2:], *cache.v))
    before = _rss_mib()
    cache.populate(0, 512)  # already there: nothing to do
    assert cache.populated[0] == (1024 if supported else 0) and _rss_mib() - before < 0.5


def test_a_decoding_request_populates_the_slot_the_next_copy_would_take(tmp_path: Path) -> None:
    """Decode steps fault in the next free slot as far as the running sequence reaches (in granules), off the
    step, so that a later request's copied prefix finds its pages; a prefill step leaves it alone."""
    make_checkpoint(tmp_path, "llama")
    model = load_model(tmp_path, torch.float32, torch.device("cpu"))
    core = EngineCore(model, num_slots=2, max_len=1024, chunk_size=512, eos_token_ids=(), device=torch.device("cpu"),
                      prefix_cache=True)
    prompt = [(7 * i + 3) % 50 for i in range(300)]
    core.add(GenerationRequest("a", prompt, SamplingParams(max_tokens=3, temperature=0.0)))
    core.step()  # the whole prompt in one chunk: nothing populated beside it
    assert core._populating is None
    while core.has_work:
        core.step()
    assert core._populating is not None
    core._populating.join()
    assert core.cache.populated == [0, 2 * POPULATE_GRANULE if _can_populate() else 0]  # 303 positions, rounded up
