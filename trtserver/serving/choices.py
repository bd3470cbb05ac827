"""One choice's state while its sequence streams (text, stop, token counts), and the completions
API's pieces of it: echo and legacy logprobs, written once for the streamed and the collected
response alike (the collected response is the stream, joined).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from trtserver.engine.base import SequenceOutput
from trtserver.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
    PromptTokensDetails,
    Usage,
)
from trtserver.text import TextStream
from trtserver.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> Usage:
    """The usage object; ``cached_tokens`` None: the engine has no prefix cache, so no details."""
    details = None if cached_tokens is None else PromptTokensDetails(cached_tokens)
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, details)


def clamp(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB


class TokenNamer:
    """Token id -> the string shown in ``logprobs.tokens`` and ``top_logprobs`` keys (cached)."""

    def __init__(self, tokenizer: Tokenizer, as_token_ids: bool) -> None:
        self._tokenizer = tokenizer
        self._as_ids = as_token_ids
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        name = self._cache.get(token_id)
        if name is None:
            if self._as_ids:
                name = f"token_id:{token_id}"
            else:
                name = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = name
        return name


def legacy_logprobs(namer: TokenNamer, token_ids: list[int], token_logprobs: Sequence[float | None],
                    tops: Sequence[Sequence[tuple[int, float]] | None] | None, k: int, offset: int
                    ) -> tuple[CompletionLogprobs, int]:
    """Build the legacy object for a run of tokens; returns it and the next text offset."""
    out = CompletionLogprobs()
    for i, token_id in enumerate(token_ids):
        name = namer(token_id)
        lp = token_logprobs[i]
        out.tokens.append(name)
        out.token_logprobs.append(None if lp is None else clamp(lp))
        out.text_offset.append(offset)
        offset += len(name)
        top = tops[i] if tops is not None else None
        if lp is None:
            out.top_logprobs.append(None)
            continue
        entries: dict[str, float] = {}
        for alt_id, alt_lp in (top or [])[:k]:
            entries.setdefault(namer(alt_id), clamp(alt_lp))
        entries.setdefault(name, clamp(lp))
        out.top_logprobs.append(entries)
    return out, offset


def vllm_prompt_logprobs(namer: TokenNamer, prompt_ids: list[int], token_lps: Sequence[float | None],
                         tops: Sequence[Sequence[tuple[int, float]] | None]) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs``: per position, {token_id: {logprob, rank, decoded_token}}."""
    result: list[dict[str, PromptLogprob] | None] = []
    for i, token_id in enumerate(prompt_ids):
        lp = token_lps[i] if i < len(token_lps) else None
        if lp is None:
            result.append(None)
            continue
        top = tops[i] or [] if i < len(tops) else []
        ranks = {alt: rank + 1 for rank, (alt, _) in enumerate(top)}
        entry = {str(token_id): PromptLogprob(clamp(lp), ranks.get(token_id), namer(token_id))}
        for alt_id, alt_lp in top:
            entry.setdefault(str(alt_id), PromptLogprob(clamp(alt_lp), ranks[alt_id], namer(alt_id)))
        result.append(entry)
    return result


@dataclass(slots=True)
class ChoiceState:
    """Per-choice accumulation; ``advance`` turns one engine delta into what to send."""

    prompt_index: int
    seq_index: int
    text: TextStream
    prompt_tokens: int
    echo_text: str = ""
    eos_token_ids: tuple[int, ...] = ()
    completion_tokens: int = 0
    logprob_sum: float = 0.0
    offset: int = 0
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False
    token_ids: list[int] = field(default_factory=list)
    cached_tokens: int | None = None  # of its prompt's tokens, those the prefix cache served; None: no cache

    beam_score: float | None = None

    def usage(self) -> Usage:
        """This choice's tokens so far (``continuous_usage_stats``)."""
        return make_usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def score(self) -> float:
        """How best_of and beam search rank choices: beam score, else mean token logprob."""
        if self.beam_score is not None:
            return self.beam_score
        return self.logprob_sum / self.completion_tokens if self.completion_tokens else float("-inf")

    def visible_tokens(self, delta: SequenceOutput) -> list[int]:
        """The delta's tokens that become text: a final EOS is never shown."""
        ids = delta.token_ids
        if (delta.finish_reason == "stop" and delta.stop_token_id is None and ids
                and ids[-1] in self.eos_token_ids):
            return ids[:-1]
        return ids

    def advance(self, delta: SequenceOutput) -> str:
        """Apply a delta; returns the text that may be sent now. Sets ``finished`` when done."""
        self.completion_tokens += len(delta.token_ids)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprob_sum += sum(delta.logprobs)
        stop = self.text.add(self.visible_tokens(delta))
        if stop is not None:
            self.finished = True
            self.finish_reason = "stop"
            self.stop_reason = stop.reason
        elif delta.finish_reason is not None:
            self.finished = True
            self.finish_reason = "stop" if delta.finish_reason == "stop" else delta.finish_reason
            self.stop_reason = delta.stop_token_id
        return self.text.take(final=self.finished)


def extend_logprobs(into: CompletionLogprobs, more: CompletionLogprobs) -> None:
    into.tokens += more.tokens
    into.token_logprobs += more.token_logprobs
    into.top_logprobs += more.top_logprobs
    into.text_offset += more.text_offset


@dataclass(frozen=True, slots=True)
class PromptScores:
    token_logprobs: list[float | None]  # first is None
    top: list[list[tuple[int, float]] | None]


def choice_piece(request: CompletionRequest, prompt_ids: list[int], choice: ChoiceState, delta: SequenceOutput,
                 text: str, first: bool, namer: TokenNamer, stride: int, scores: PromptScores | None
                 ) -> CompletionChoice | None:
    """The completion choice's piece of the chunk for one applied engine delta (None: nothing to
    send yet). The first piece carries echo, prompt logprobs and prompt token ids."""
    if request.use_beam_search:
        choice.beam_score = delta.cumulative_logprob
    logprobs: CompletionLogprobs | None = None
    prompt_lps = None
    loglikelihood = None
    if first and scores is not None:
        if request.prompt_logprobs is not None:
            prompt_lps = vllm_prompt_logprobs(namer, prompt_ids, scores.token_logprobs, scores.top)
        if request.loglikelihood:
            loglikelihood, _ = legacy_logprobs(namer, prompt_ids[1:], scores.token_logprobs[1:],
                                               scores.top[1:], request.logprobs or 0, 0)
    if first and request.echo:
        if request.logprobs is not None and scores is not None:
            logprobs, choice.offset = legacy_logprobs(namer, prompt_ids, scores.token_logprobs,
                                                      scores.top, request.logprobs, 0)
        else:
            choice.offset = len(choice.echo_text)
        text = choice.echo_text + text
    if request.logprobs is not None and delta.logprobs is not None and delta.token_ids:
        generated, choice.offset = legacy_logprobs(namer, delta.token_ids, list(delta.logprobs),
                                                   delta.top_logprobs, request.logprobs, choice.offset)
        if logprobs is None:
            logprobs = generated
        else:
            extend_logprobs(logprobs, generated)
    if not text and logprobs is None and not choice.finished and not first and not (
            request.return_token_ids and delta.token_ids):
        return None
    out = CompletionChoice(
        text=text,
        index=choice.prompt_index * stride + choice.seq_index,
        logprobs=logprobs,
        finish_reason=choice.finish_reason if choice.finished else None,  # type: ignore[arg-type]
        stop_reason=choice.stop_reason if choice.finished else None,
    )
    if prompt_lps is not None:
        out.prompt_logprobs = prompt_lps
    if loglikelihood is not None:
        out.loglikelihood = loglikelihood
    if request.return_token_ids:
        if first:
            out.prompt_token_ids = prompt_ids
        out.token_ids = list(delta.token_ids)
    return out


class ChoiceMerger:
    """Streamed chunks joined back into whole choices (the non-streaming response is built this way)."""

    def __init__(self) -> None:
        self.choices: dict[int, CompletionChoice] = {}

    def add(self, chunk: CompletionResponse) -> None:
        for piece in chunk.choices:
            into = self.choices.get(piece.index)
            if into is None:
                self.choices[piece.index] = piece
                continue
            into.text += piece.text
            if piece.logprobs is not None:
                if into.logprobs is None:
                    into.logprobs = piece.logprobs
                else:
                    extend_logprobs(into.logprobs, piece.logprobs)
            if isinstance(piece.token_ids, list):
                into.token_ids = (into.token_ids if isinstance(into.token_ids, list) else []) + piece.token_ids
            if piece.finish_reason is not None:
                into.finish_reason = piece.finish_reason
                into.stop_reason = piece.stop_reason

    def keep_best(self, score: Callable[[int, int], float], prompts: int, n: int, width: int) -> None:
        """Per prompt, the n of ``width`` choices with the best score, re-indexed ``prompt_idx * n + rank``."""
        kept: dict[int, CompletionChoice] = {}
        for p in range(prompts):
            ranked = sorted(range(width), key=lambda s: -score(p, s))
            for rank, s in enumerate(ranked[:n]):
                choice = self.choices.get(p * width + s)
                if choice is not None:
                    choice.index = p * n + rank
                    kept[choice.index] = choice
        self.choices = kept

    def ordered(self) -> list[CompletionChoice]:
        return [self.choices[i] for i in sorted(self.choices)]
