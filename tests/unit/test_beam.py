"""Beam scores compared by their logarithm: the formula's order, for any length penalty."""

from __future__ import annotations

import itertools
import math

import pytest

from trtserver.engine.torch.beam import BeamState, rank_key, saturated_score


@pytest.mark.parametrize("penalty", [-3.0, -1.0, 0.0, 0.5, 1.0, 2.0])
def test_rank_orders_like_the_formula(penalty: float) -> None:
    cases = [(s, n) for s, n in itertools.product([-0.1, -1.0, -2.5, -7.0, -30.0], [1, 2, 3, 8, 40])]
    by_formula = sorted(cases, key=lambda c: c[0] / c[1] ** penalty)
    by_rank = sorted(cases, key=lambda c: rank_key(c[0], c[1], penalty))
    assert [c[0] / c[1] ** penalty for c in by_formula] == pytest.approx([c[0] / c[1] ** penalty for c in by_rank])
    for s, n in cases:
        assert saturated_score(s, rank_key(s, n, penalty)) == pytest.approx(s / n ** penalty)


@pytest.mark.parametrize("penalty", [1e308, -1e308, -1000.0, math.inf, -math.inf, math.nan])
def test_extreme_penalties_neither_overflow_nor_divide_by_zero(penalty: float) -> None:
    for early in (False, True, "never"):
        beam = BeamState(2, penalty, early, 50, frozenset())
        beam.sums = [0.0, 0.0]
        for s, n in ((-1.0, 1), (-2.0, 3), (-0.5, 7), (0.0, 2), (-math.inf, 4)):
            beam.add([1] * n, s, "stop")
        assert len(beam.hyps) == 2
        beam.is_done(-3.0, 9)
        assert all(isinstance(h.score, float) for h in beam.hyps)
