"""``top_k.cpp``'s ``top_k_indices``: the refined int4 head's selection, the same set as ``topk``'s."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 49152, 256), (3, 4096, 256), (2, 300, 300), (1, 10, 1)])
def test_top_k_indices_selects_what_topk_selects(ops, rows: int, n: int, k: int) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(n + k)
    scores = torch.randn(rows, n, generator=g) * 8
    scores[0, :5] = torch.tensor([-1e30, 1e30, -0.0, 0.0, float("-inf")])  # both zeros, both ends of the range
    got = ops.top_k_indices(scores, k)
    assert got.shape == (rows, k) and got.dtype == torch.long
    want = scores.topk(k, dim=-1).indices
    for r in range(rows):
        assert sorted(got[r].tolist()) == sorted(want[r].tolist())


def test_top_k_indices_takes_ties_at_the_boundary_up_to_k(ops) -> None:  # type: ignore[no-untyped-def]
    scores = torch.tensor([[1.0, 3.0, 2.0, 2.0, 2.0, 0.5]])
    got = ops.top_k_indices(scores, 3)[0].tolist()
    assert len(set(got)) == 3 and 1 in got and set(got) - {1} <= {2, 3, 4}
    clustered = torch.full((1, 5000), 7.0) + torch.arange(5000) * 1e-6  # one histogram bin holds every score
    assert sorted(ops.top_k_indices(clustered, 64)[0].tolist()) == list(range(5000 - 64, 5000))


def test_top_k_indices_refuses_what_it_cannot_read(ops) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match="float32"):
        ops.top_k_indices(torch.randn(2, 8).double(), 2)
    with pytest.raises(RuntimeError, match="k must be"):
        ops.top_k_indices(torch.randn(2, 8), 9)
