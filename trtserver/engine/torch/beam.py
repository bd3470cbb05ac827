"""Beam search over a request's ``n`` slots, with Hugging Face's scoring and stopping rules."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from trtserver.engine.base import FinishReason


@dataclass(slots=True)
class Hypothesis:
    score: float  # sum_logprobs / generated_len ** length_penalty
    token_ids: list[int]
    finish_reason: FinishReason


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

    def score(self, sum_logprobs: float, length: int) -> float:
        return sum_logprobs / (max(length, 1) ** self.length_penalty)

    def add(self, token_ids: list[int], sum_logprobs: float, reason: FinishReason) -> None:
        score = self.score(sum_logprobs, len(token_ids))
        if len(self.hyps) < self.width or score > self.hyps[-1].score:
            self.hyps.append(Hypothesis(score, token_ids, reason))
            self.hyps.sort(key=lambda h: -h.score)
            del self.hyps[self.width:]

    def is_done(self, best_sum: float, cur_len: int) -> bool:
        """HF ``BeamHypotheses.is_done``: can no running beam beat the worst kept hypothesis?"""
        if len(self.hyps) < self.width:
            return False
        if self.early_stopping is True:
            return True
        if self.early_stopping == "never" and self.length_penalty > 0:
            best_possible = best_sum / (self.max_tokens ** self.length_penalty)
        else:
            best_possible = best_sum / (cur_len ** self.length_penalty)
        return self.hyps[-1].score >= best_possible

    def step(self, outputs: list[list[int]], logprobs: Tensor, first: bool,
             at_limit: bool) -> list[tuple[int, int]]:
        """Advance every beam by one token.

        ``outputs`` are the running beams' tokens, ``logprobs`` their next-token log-probabilities
        ``(W, V)``. Returns ``(parent, token)`` for each new running beam, in order (empty when
        the search is done).
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
        if self.is_done(max(new_sums), cur_len):
            self.done = True
            return []
        self.sums = new_sums
        return beams
