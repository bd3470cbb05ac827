"""Beam search over a request's ``n`` slots, with Hugging Face's scoring and stopping rules.

Scores (``sum_logprobs / length ** length_penalty``) are compared by their logarithm, so any
length penalty orders hypotheses as the formula does without overflowing or dividing by zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from trtserver.engine.base import FinishReason


@dataclass(slots=True)
class Hypothesis:
    score: float  # sum_logprobs / generated_len ** length_penalty (saturated to a float)
    token_ids: list[int]
    finish_reason: FinishReason
    rank: float = 0.0  # orders hypotheses as ``score`` would with unbounded floats (``rank_key``)


def rank_key(sum_logprobs: float, length: int, length_penalty: float) -> float:
    """A number that orders ``sum_logprobs / length ** length_penalty`` (sum <= 0) the same way:
    minus the logarithm of its magnitude."""
    if sum_logprobs >= 0.0:
        return math.inf
    if math.isinf(sum_logprobs):
        return -math.inf
    scale = length_penalty * math.log(length) if length > 1 else 0.0
    key = scale - math.log(-sum_logprobs)
    return key if key == key else -math.inf  # a NaN (inf - inf) ranks last


def saturated_score(sum_logprobs: float, key: float) -> float:
    """The score itself, as a float: -inf past the largest float, -0.0 below the smallest."""
    if sum_logprobs >= 0.0:
        return 0.0
    if key < -709.0:
        return -math.inf
    return -math.exp(-key)


@dataclass(slots=True)
class BeamState:
    width: int
    length_penalty: float
    early_stopping: bool | str
    max_tokens: int
    end_ids: frozenset[int]  # EOS (unless ignore_eos) and stop tokens
    sums: list[float] = field(default_factory=list)  # cumulative logprob of each running beam
    hyps: list[Hypothesis] = field(default_factory=list)
    done: bool = False

    def rank(self, sum_logprobs: float, length: int) -> float:
        return rank_key(sum_logprobs, max(length, 1), self.length_penalty)

    def add(self, token_ids: list[int], sum_logprobs: float, reason: FinishReason) -> None:
        rank = self.rank(sum_logprobs, len(token_ids))
        if len(self.hyps) < self.width or rank > self.hyps[-1].rank:
            self.hyps.append(Hypothesis(saturated_score(sum_logprobs, rank), token_ids, reason, rank))
            self.hyps.sort(key=lambda h: -h.rank)
            del self.hyps[self.width:]

    def is_done(self, best_sum: float, cur_len: int) -> bool:
        """HF ``BeamHypotheses.is_done``: can no running beam beat the worst kept hypothesis?"""
        if len(self.hyps) < self.width:
            return False
        if self.early_stopping is True:
            return True
        if self.early_stopping == "never" and self.length_penalty > 0:
            best_possible = self.rank(best_sum, self.max_tokens)
        else:
            best_possible = self.rank(best_sum, cur_len)
        return self.hyps[-1].rank >= best_possible

    def step(self, outputs: list[list[int]], logprobs: Tensor, first: bool,
             at_limit: bool) -> list[tuple[int, int]]:
        """Advance every beam by one token.

        ``outputs`` are the running beams' tokens, ``logprobs`` their next-token log-probabilities
        ``(W, V)``. Returns ``(parent, token)`` for each new running beam, in order (empty when
        the search is done, also when every candidate ended).
        """
        width, vocab = self.width, logprobs.shape[1]
        sums = torch.tensor(self.sums, dtype=logprobs.dtype, device=logprobs.device)
        candidates = logprobs[:1] if first else logprobs + sums.unsqueeze(1)  # (W, V); all beams equal at first
        values, indices = candidates.flatten().topk(min(2 * width, candidates.numel()))
        cur_len = len(outputs[0]) + 1
        beams: list[tuple[int, int]] = []
        new_sums: list[float] = []
        for rank, (value, index) in enumerate(zip(values.tolist(), indices.tolist())):
            parent, token = divmod(index, vocab)
            if token in self.end_ids:
                if rank < width:
                    self.add(outputs[parent] + [token], value, "stop")
                continue
            beams.append((parent, token))
            new_sums.append(value)
            if len(beams) == width:
                break
        if at_limit or cur_len >= self.max_tokens:
            for (parent, token), value in zip(beams, new_sums):
                self.add(outputs[parent] + [token], value, "length")
            self.done = True
            return []
        if not beams or self.is_done(max(new_sums), cur_len):
            self.done = True
            return []
        self.sums = new_sums
        return beams
