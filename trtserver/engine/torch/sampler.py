"""One batched sampler for every sampling parameter.

The order, per step, for a batch of rows (one per sequence):

1. logits processors (per row, only rows that have them), repetition / frequency / presence
   penalties, ``logit_bias``, ``allowed_token_ids``, ``min_tokens`` (EOS and stop tokens masked
   until reached) and guided-decoding bitmasks (one int32 mask for the batch, applied in one op);
2. logprobs, when any row asked: ``log_softmax`` of the logits *after* step 1 and *before*
   temperature, top-k, top-p and min-p (vLLM's convention: the model's distribution under the
   request's hard constraints, not the sampling distribution);
3. temperature, top-k, top-p, min-p, then one draw per row by inverse CDF from a single uniform
   number taken from the row's own ``torch.Generator`` (seeded rows: the sequence's generator,
   so the same seed gives the same tokens whatever else is in the batch). Rows with temperature
   < 1e-5 take the argmax. Top-k keeps exactly k tokens and top-p grows the nucleus in greedy's
   order, ties going to the lowest id as argmax breaks them: ``top_k=1`` or a tiny ``top_p`` is
   greedy.

The common case (no penalties, processors, biases or guides) has no per-row tensor work; the
only host sync is reading the sampled ids (and the logprobs, when asked).

A row whose own work raises (a plugin's processor or guide) is reported in ``SampleResult.failed``
and the batch goes on without it: its row is left neutral, its token is not to be used.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from trtserver.errors import APIError, EngineError, InvalidRequest

if TYPE_CHECKING:
    from trtserver.engine.base import SamplingParams
    from trtserver.engine.torch.sequence import Sequence

NEG_INF = float("-inf")


def on_device(values: Seq[float] | Seq[int] | Seq[bool], device: torch.device) -> Tensor:
    """A per-row parameter list on ``device``; on CUDA through pinned memory, so the copy does not wait
    for the decode step still running on the GPU."""
    t = torch.tensor(values)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None = None  # of each sampled token, when any row asked (or beams)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per row, up to that row's k
    failed: dict[int, BaseException] = field(default_factory=dict)  # rows whose own work raised


def no_token_allowed(seq: Sequence) -> InvalidRequest:
    """The error of a sequence whose constraints, together, allow no next token."""
    p = seq.params
    if seq.constraint is not None:
        return InvalidRequest("guided decoding allows no token after the text generated so far "
                              f"({len(seq.output_ids)} tokens): the guide cannot be completed", param="guided")
    rules: list[tuple[str | None, str]] = []
    if p.allowed_token_ids is not None:
        rules.append(("allowed_token_ids", "allowed_token_ids"))
    if len(seq.output_ids) < p.min_tokens:
        rules.append(("min_tokens", f"min_tokens (no EOS or stop token before token {p.min_tokens + 1})"))
    if seq.processors:
        rules.append((None, "the logits processors (bad words, ...)"))
    return InvalidRequest(f"no token is allowed at generated token {len(seq.output_ids) + 1}: "
                          f"{' and '.join(text for _, text in rules)} rule out every token",
                          param=rules[0][0] if rules else None)


def row_error(what: str, exc: BaseException) -> BaseException:
    """The error a request's stream raises when its own object (``what``) failed: a client error
    the object raised stays one; anything else is the engine's."""
    if isinstance(exc, APIError):
        return exc
    return EngineError(f"{what} failed: {exc!r}")


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: Seq[int], device: torch.device, seed: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = device
        self.generator = torch.Generator(device=device)  # shared by unseeded rows
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        words = (vocab_size + 31) // 32
        self._bit_shifts = torch.arange(32, dtype=torch.int32, device=device)
        self.bitmask_words = words

    def new_generator(self, seed: int, index: int) -> torch.Generator:
        """The generator of sequence ``index`` of a request seeded with ``seed``."""
        g = torch.Generator(device=self.device)
        g.manual_seed((seed * 1_000_003 + index * 7919) % (2**63 - 1) if index else seed % (2**63 - 1))
        return g

    # ---- step 1 ---------------------------------------------------------------------------
    def process(self, logits: Tensor, rows: Seq[Sequence], failed: dict[int, BaseException] | None = None) -> Tensor:
        """Apply processors, penalties, biases and masks to ``logits`` (B, V) in place. A row whose
        logits processor or guide raises, or whose masks leave no token allowed, goes into
        ``failed`` (row -> error), its logits zeroed."""
        if failed is None:
            failed = {}
        masked: list[int] = []  # rows that something may have masked entirely
        for i, seq in enumerate(rows):
            p = seq.params
            if seq.processors:
                masked.append(i)
                try:
                    for proc in seq.processors:
                        proc(seq.output_ids, logits[i])
                except Exception as exc:  # noqa: BLE001 - a plugin's object: its request fails, not the batch
                    failed[i] = row_error("a logits processor", exc)
                    logits[i] = 0.0
                    continue
            if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
                self._penalize(logits[i], seq)
            if p.logit_bias:
                ids = torch.tensor([t for t, _ in p.logit_bias], device=logits.device)
                bias = torch.tensor([b for _, b in p.logit_bias], device=logits.device, dtype=logits.dtype)
                logits[i].index_add_(0, ids, bias)
            if p.allowed_token_ids is not None:
                masked.append(i)
                keep = logits[i, list(p.allowed_token_ids)].clone()
                logits[i].fill_(NEG_INF)
                logits[i, list(p.allowed_token_ids)] = keep
            if len(seq.output_ids) < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
                if banned:
                    masked.append(i)
                    logits[i, banned] = NEG_INF
        if any(seq.constraint is not None for seq in rows):
            self.apply_bitmask(logits, self.fill_bitmask(rows, failed))
            masked += [i for i, seq in enumerate(rows) if seq.constraint is not None]
        if masked:
            self._find_dead_rows(logits, rows, masked, failed)
        if failed:
            logits[list(failed)] = 0.0
        return logits

    def _find_dead_rows(self, logits: Tensor, rows: Seq[Sequence], masked: list[int],
                        failed: dict[int, BaseException]) -> None:
        """Rows where no token is allowed any more fail with the request's error: a token the
        constraints forbid is never drawn."""
        dead = torch.isneginf(logits[masked].amax(dim=-1)).tolist()
        for i, is_dead in zip(masked, dead):
            if is_dead and i not in failed:
                failed[i] = no_token_allowed(rows[i])

    def _penalize(self, row: Tensor, seq: Sequence) -> None:
        p = seq.params
        out = torch.tensor(seq.output_ids, dtype=torch.long, device=row.device)
        counts = torch.bincount(out, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
        if p.repetition_penalty != 1.0:  # HF / vLLM: prompt and output tokens
            seen = counts > 0
            seen[torch.tensor(seq.prompt_ids, dtype=torch.long, device=row.device)] = True
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, penalized, row))
        if p.frequency_penalty:
            row.sub_(counts * p.frequency_penalty)
        if p.presence_penalty:
            row.sub_((counts > 0).to(row.dtype) * p.presence_penalty)

    def fill_bitmask(self, rows: Seq[Sequence], failed: dict[int, BaseException] | None = None) -> Tensor:
        """One ``(B, ceil(V / 32))`` int32 mask; unconstrained rows (and rows whose guide raised,
        reported in ``failed``) allow everything."""
        mask = torch.full((len(rows), self.bitmask_words), -1, dtype=torch.int32)
        for i, seq in enumerate(rows):
            if seq.constraint is not None:
                mask[i] = 0
                try:
                    seq.constraint.fill_bitmask(mask, i)
                except Exception as exc:  # noqa: BLE001 - a plugin's guide: its request fails, not the batch
                    mask[i] = -1
                    if failed is not None:
                        failed[i] = row_error("the guided decoder", exc)
                    else:
                        raise
        return mask

    def apply_bitmask(self, logits: Tensor, mask: Tensor) -> None:
        """Unpack bits (bit t % 32 of word t // 32 = token t allowed) and mask the rest."""
        mask = mask.to(logits.device, non_blocking=True)
        bits = (mask.unsqueeze(-1) >> self._bit_shifts) & 1  # (B, W, 32)
        allowed = bits.view(mask.shape[0], -1)[:, : logits.shape[1]].bool()  # (B, V)
        logits.masked_fill_(~allowed, NEG_INF)

    # ---- steps 2 and 3 --------------------------------------------------------------------
    def sample(self, logits: Tensor, rows: Seq[Sequence], *, want_logprobs: bool = False) -> SampleResult:
        """Process ``logits`` (B, V) float32 in place and draw one token per row."""
        failed: dict[int, BaseException] = {}
        self.process(logits, rows, failed)
        params = [seq.params for seq in rows]
        top_k = [p.logprobs or 0 for p in params]
        need_logprobs = want_logprobs or any(p.logprobs is not None for p in params)
        logprobs = torch.log_softmax(logits, dim=-1) if need_logprobs else None

        if all(p.temperature < 1e-5 for p in params):
            ids = logits.argmax(dim=-1)
        else:
            ids = self._draw(logits, rows)

        token_ids: list[int] = ids.tolist()
        result = SampleResult(token_ids, failed=failed)
        if logprobs is not None:
            result.logprobs = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
            k = max(top_k)
            result.top_logprobs = [[] for _ in rows]
            if k:
                top_values, top_indices = logprobs.topk(k, dim=-1)
                values, indices = top_values.tolist(), top_indices.tolist()
                result.top_logprobs = [list(zip(indices[i][: top_k[i]], values[i][: top_k[i]]))
                                       for i in range(len(rows))]
        return result

    def _draw(self, logits: Tensor, rows: Seq[Sequence]) -> Tensor:
        params = [seq.params for seq in rows]
        dev = logits.device
        greedy = [p.temperature < 1e-5 for p in params]
        temps = on_device([1.0 if g else p.temperature for g, p in zip(greedy, params)], dev)
        scaled = logits / temps.unsqueeze(1)  # (B, V)
        if any(p.top_k > 0 for p in params):
            scaled.masked_fill_(self._top_k_drop(logits, params), NEG_INF)
        if any(p.top_p < 1.0 for p in params):
            top_p = on_device([p.top_p for p in params], dev).unsqueeze(1)
            values = scaled.sort(dim=-1, descending=True).values
            probs = values.softmax(dim=-1)
            # the nucleus: as many tokens as it takes for the mass before the last to stay <= top_p
            size = ((probs.cumsum(dim=-1) - probs) <= top_p).sum(dim=-1, keepdim=True)  # (B, 1), >= 1
            size = torch.where(top_p >= 1.0, scaled.shape[1], size)
            scaled.masked_fill_(keep_only(scaled, values, size), NEG_INF)
        probs = scaled.softmax(dim=-1)  # (B, V)
        if any(p.min_p > 0.0 for p in params):
            min_p = on_device([p.min_p for p in params], dev).unsqueeze(1)
            probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        cdf = probs.cumsum(dim=-1)  # (B, V)
        # one uniform in (0, 1] per row, each from the row's own generator (one draw when none is seeded)
        if all(seq.generator is None for seq in rows):
            u = 1.0 - torch.rand(len(rows), device=dev, generator=self.generator)
        else:
            u = 1.0 - torch.cat([torch.rand(1, device=dev, generator=seq.generator or self.generator) for seq in rows])
        ids = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).squeeze(1).clamp_(max=cdf.shape[1] - 1)
        if any(greedy):
            ids = torch.where(on_device(greedy, dev), logits.argmax(dim=-1), ids)
        return ids

    @staticmethod
    def _top_k_drop(logits: Tensor, params: Seq[SamplingParams]) -> Tensor:
        """Which tokens each row's top-k drops (none, for rows without one), ranked on the logits
        before temperature."""
        dev, vocab = logits.device, logits.shape[1]
        ks = [min(p.top_k, vocab) if p.top_k > 0 else 1 for p in params]
        values = logits.topk(min(max(ks) + 1, vocab), dim=-1).values  # (B, kmax + 1), descending
        drop = keep_only(logits, values, on_device(ks, dev).unsqueeze(1))
        off = [p.top_k <= 0 for p in params]
        if any(off):
            drop.masked_fill_(on_device(off, dev).unsqueeze(1), False)
        return drop


def keep_only(x: Tensor, values: Tensor, k: Tensor) -> Tensor:
    """The mask of what to drop from each row of ``x`` (B, V) to keep exactly ``k`` (B, 1) of its
    largest, ties at the k-th value going to the lowest ids as argmax breaks them: keeping one
    is greedy. ``values``: each row's largest values, descending, at least k + 1 of them or all V."""
    width = values.shape[1]
    kth = values.gather(1, k - 1)  # (B, 1): the k-th largest value
    drop = x < kth
    # more than k kept only where the next value ties with the k-th (on CPU, checked for free)
    surplus = (values.gather(1, k.clamp(max=width - 1)) == kth) & (k < width)
    if x.device.type != "cpu" or bool(surplus.any()):
        tied = (x == kth) & surplus
        room = k - (x > kth).sum(dim=-1, keepdim=True)
        drop |= tied & (tied.cumsum(dim=-1) > room)
    return drop
