"""TensorRT-LLM ``RequestOutput`` states -> our ``SequenceOutput`` deltas.

Each step reads the (mutable, shared) RequestOutput as it is now. New tokens are the cumulative
``CompletionOutput.token_ids`` past what was already sent, which every generation has and which
stays right even if several executor responses arrived between two reads (``token_ids_diff`` is
relative to the previous *response*, not to our previous read). Logprobs come in two shapes
(``list[dict[id, Logprob]]`` or ``list[float]``) and, on some versions, only as the newest part
while streaming; both are handled. ``finish_reason`` is mapped when the version has it (0.14+)
and inferred from the last token otherwise.

Prompt logprobs are computed here from ``RequestOutput.context_logits`` (asked for with
``return_context_logits``): row *i* is the distribution at prompt position *i*, which scores prompt
token *i + 1*; TensorRT-LLM's own ``prompt_logprobs`` are the top k of those rows without the real
token, so they cannot score a prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trtserver.engine.base import FinishReason, GenerationRequest, SequenceOutput

_FINISH = {"stop": "stop", "length": "length", "cancelled": "abort", "timeout": "abort"}
LOGPROB_FLOOR = -9999.0


def _logprob_value(entry: Any) -> float:
    value = getattr(entry, "logprob", entry)
    return max(float(value), LOGPROB_FLOOR)


def split_logprob(item: Any, token_id: int, k: int) -> tuple[float, list[tuple[int, float]] | None]:
    """One position: the sampled token's logprob and the top-``k`` alternatives (None if unknown)."""
    if isinstance(item, dict):
        chosen = _logprob_value(item[token_id]) if token_id in item else LOGPROB_FLOOR
        ranked = sorted(item.items(), key=lambda kv: (getattr(kv[1], "rank", None) or 1 << 30,
                                                      -_logprob_value(kv[1])))
        return chosen, [(int(t), _logprob_value(v)) for t, v in ranked[:k]]
    return _logprob_value(item), None


class StreamTranslator:
    """Turns successive RequestOutput states of one request into deltas."""

    def __init__(self, request: GenerationRequest, *, eos_ids: Sequence[int], our_stop_ids: frozenset[int],
                 max_tokens: int, has_finish_reason: bool, vocab_size: int = 0,
                 logits_logprobs: bool = False, reports_cached_tokens: bool = False) -> None:
        self.request = request
        self.reports_cached = reports_cached_tokens
        self.cached_tokens = 0
        """``RequestOutput.cached_tokens`` as last read: the prompt tokens whose K/V blocks were reused."""
        self.responded = False
        self.logits_logprobs = logits_logprobs
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(eos_ids)
        self.stop_ids = frozenset(request.sampling.stop_token_ids)
        self.our_stop_ids = our_stop_ids
        self.max_tokens = max_tokens
        self.has_finish_reason = has_finish_reason
        self.beam = request.sampling.use_beam_search
        self.ignore_eos = request.sampling.ignore_eos
        self.k = request.sampling.logprobs
        count = request.n
        self.sent = [0] * count
        self.done = [False] * count
        self.prompt_sent = request.sampling.prompt_logprobs is None

    @property
    def finished(self) -> bool:
        return all(self.done)

    def step(self, output: Any) -> list[SequenceOutput]:
        final = bool(getattr(output, "finished", False))
        self.responded = True
        if self.reports_cached:
            self.cached_tokens = int(getattr(output, "cached_tokens", 0) or 0)
        if self.beam and not final:
            return []
        prompt_rows = None
        if not self.prompt_sent:
            prompt_rows = getattr(output, "context_logits", None)
            if prompt_rows is None and not final:
                return []  # tokens are cumulative: they follow with the prompt's logprobs
        deltas = []
        for seq in output.outputs:
            index = int(seq.index)
            if index >= len(self.done) or self.done[index]:
                continue
            delta = self._sequence(seq, index, final, prompt_rows)
            if delta is not None:
                deltas.append(delta)
        if final:  # anything the executor did not report on is over now
            for index, done in enumerate(self.done):
                if not done:
                    deltas.append(self.finish(index, "abort"))
        for delta in deltas:
            delta.num_cached_tokens = self.cached_tokens
        return deltas

    def finish(self, index: int, reason: FinishReason) -> SequenceOutput:
        self.done[index] = True
        return SequenceOutput(request_id=self.request.request_id, index=index, token_ids=[],
                              finish_reason=reason, num_prompt_tokens=len(self.request.prompt_token_ids))

    def _sequence(self, seq: Any, index: int, final: bool, prompt_rows: Any) -> SequenceOutput | None:
        all_ids = list(seq.token_ids)
        start = 0 if self.beam else self.sent[index]
        new = all_ids[start:self.max_tokens]
        reason: FinishReason | None = None
        stop_token: int | None = None
        for j, tok in enumerate(new):  # stop ids TRT-LLM was not told about
            if tok in self.our_stop_ids:
                new = new[:j + 1]
                reason, stop_token = "stop", (None if tok in self.eos_ids else tok)
                break
        if self.max_tokens == 0:  # prompt scoring: TRT-LLM was asked for 1 token, which is dropped
            reason = "length"
        if reason is None:
            raw = getattr(seq, "finish_reason", None) if self.has_finish_reason else None
            if raw is not None:
                reason = _FINISH.get(str(raw), "stop")  # type: ignore[assignment]
                stop_token = self._stop_token(getattr(seq, "stop_reason", None), all_ids)
            elif final:
                reason, stop_token = self._infer(all_ids)
        if not new and reason is None:
            return None
        delta = SequenceOutput(request_id=self.request.request_id, index=index, token_ids=new,
                               finish_reason=reason, stop_token_id=stop_token if reason == "stop" else None,
                               num_prompt_tokens=len(self.request.prompt_token_ids))
        if self.k is not None and new:
            self._logprobs(delta, seq, start, len(all_ids))
        if self.beam:
            delta.cumulative_logprob = float(getattr(seq, "cumulative_logprob", None) or 0.0)
        if not self.prompt_sent and index == 0:
            self._prompt_logprobs(delta, prompt_rows)
        self.sent[index] = start + len(new)
        if reason is not None:
            self.done[index] = True
        return delta

    def _stop_token(self, stop_reason: Any, ids: list[int]) -> int | None:
        if isinstance(stop_reason, int) and not isinstance(stop_reason, bool):
            return None if stop_reason in self.eos_ids else stop_reason
        if ids and ids[-1] in self.stop_ids and ids[-1] not in self.eos_ids:
            return ids[-1]
        return None

    def _infer(self, ids: list[int]) -> tuple[FinishReason, int | None]:
        """No finish_reason on this version (before 0.14)."""
        if ids and (ids[-1] in self.stop_ids or ids[-1] in self.our_stop_ids) and ids[-1] not in self.eos_ids:
            return "stop", ids[-1]
        if len(ids) >= self.max_tokens and not (ids and ids[-1] in self.eos_ids and not self.ignore_eos):
            return "length", None
        return "stop", None

    def _logprobs(self, delta: SequenceOutput, seq: Any, start: int, total: int) -> None:
        if self.logits_logprobs:
            rows = getattr(seq, "generation_logits", None)
            if rows is not None:
                delta.logprobs, delta.top_logprobs = token_logprobs(
                    rows, start, delta.token_ids, self.k or 0, self.vocab_size)
            return
        items = list(getattr(seq, "logprobs", None) or [])
        count = len(delta.token_ids)
        if len(items) >= total:  # cumulative
            items = items[start:start + count]
        else:  # only the newest part (incremental streaming)
            diff = getattr(seq, "logprobs_diff", None)
            items = list(diff)[:count] if diff else items[-count:]
        if len(items) < count:
            return
        values, tops = [], []
        for item, tok in zip(items, delta.token_ids, strict=True):
            value, top = split_logprob(item, tok, self.k or 0)
            values.append(value)
            tops.append(top)
        delta.logprobs = values
        if self.k and all(t is not None for t in tops):
            delta.top_logprobs = tops  # type: ignore[assignment]

    def _prompt_logprobs(self, delta: SequenceOutput, context_logits: Any) -> None:
        self.prompt_sent = True
        if context_logits is None:
            return
        values, tops = prompt_logprobs(context_logits, self.request.prompt_token_ids,
                                       self.request.sampling.prompt_logprobs or 0, self.vocab_size)
        delta.prompt_token_logprobs = values
        delta.prompt_logprobs = tops


def prompt_logprobs(context_logits: Any, prompt: Sequence[int], k: int, vocab_size: int = 0
                    ) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """Each prompt token's logprob (and the top ``k``) from the row before it; None for the first.

    ``context_logits`` is ``[prompt_len, vocab_padded]`` (a beam axis of 1 is dropped); columns past
    the model's ``vocab_size`` are padding and left out of the softmax.
    """
    import torch

    rows = torch.as_tensor(context_logits)
    if rows.dim() == 3:
        rows = rows[:, 0] if rows.shape[1] == 1 else rows[0]
    if 0 < vocab_size < rows.shape[-1]:
        rows = rows[:, :vocab_size]
    n = min(len(prompt), rows.shape[0] + 1) - 1
    values: list[float | None] = [None]
    tops: list[list[tuple[int, float]] | None] = [None]
    if n <= 0:
        return values, tops
    logprobs = torch.log_softmax(rows[:n].float(), dim=-1)
    targets = torch.tensor(list(prompt[1:n + 1]), dtype=torch.long, device=logprobs.device)
    values += logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).clamp_min(LOGPROB_FLOOR).tolist()
    if k:
        top_v, top_i = logprobs.topk(k, dim=-1)
        tops += [list(zip(i, v, strict=True)) for i, v in zip(top_i.tolist(),
                                                              top_v.clamp_min(LOGPROB_FLOOR).tolist(), strict=True)]
    else:
        tops += [[] for _ in range(n)]
    return values, tops


def token_logprobs(generation_logits: Any, start: int, tokens: Sequence[int], k: int, vocab_size: int = 0
                   ) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Each generated token's logprob and the top ``k``, from ``generation_logits`` rows ``start``….

    ``generation_logits`` is ``[length, vocab_padded]`` (a leading beam axis of 1 is dropped).
    """
    import torch

    rows = torch.as_tensor(generation_logits)
    if rows.dim() == 3:
        rows = rows[0]
    if 0 < vocab_size < rows.shape[-1]:
        rows = rows[:, :vocab_size]
    logprobs = torch.log_softmax(rows[start:start + len(tokens)].float(), dim=-1)
    targets = torch.tensor(list(tokens), dtype=torch.long, device=logprobs.device)
    values = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).clamp_min(LOGPROB_FLOOR).tolist()
    top_v, top_i = logprobs.topk(k, dim=-1)
    tops = [list(zip(i, v, strict=True)) for i, v in zip(top_i.tolist(),
                                                         top_v.clamp_min(LOGPROB_FLOOR).tolist(), strict=True)]
    return values, tops
