"""One engine step: schedule, run the model, sample, turn the results into deltas.

``EngineCore.step()`` is nano-vllm's three-call loop (schedule → run → postprocess); it runs on
the runner's worker thread only, and never touches asyncio.

A request whose own work fails in a step (its logits processor or guide raises, its beam search
breaks) is failed alone (``_fail``): the other requests of the step keep their tokens. Only a
failure of the batch itself (the model's forward) fails every request of the step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from trtserver.engine.base import EngineStats, FinishReason, GenerationRequest, SequenceOutput
from trtserver.engine.torch.beam import BeamState
from trtserver.engine.torch.cache import KVCache
from trtserver.engine.torch.model import Transformer
from trtserver.engine.torch.model_runner import DecodeFn, ModelRunner
from trtserver.engine.torch.prepare import Preparer
from trtserver.engine.torch.sampler import Sampler, row_error
from trtserver.engine.torch.scheduler import PrefillChunk, Scheduler
from trtserver.engine.torch.sequence import Group, Sequence
from trtserver.errors import EngineError, InvalidRequest

if TYPE_CHECKING:
    from trtserver.engine.torch.lora import LoraManager

log = logging.getLogger(__name__)

POPULATE_GRANULE = 256  # positions: the populated prefix grows in steps this wide


class EngineCore:
    def __init__(self, model: Transformer, *, num_slots: int, max_len: int, chunk_size: int,
                 eos_token_ids: Seq[int], device: torch.device, seed: int | None = None,
                 small_batch: int = 0, threads: tuple[int, int] | None = None, lora: LoraManager | None = None,
                 decode: DecodeFn | None = None, prefix_cache: bool = False, cache_slots: int = 0) -> None:
        """``small_batch``, ``threads``, ``lora`` and ``decode`` (the accelerated decode) go to the
        model's runner (``model_runner.ModelRunner``).

        ``prefix_cache``: reuse the K/V of prompt prefixes already computed (``prefix_cache.py``), kept
        in finished sequences' slots and in ``cache_slots`` slots beyond the ``num_slots`` running ones."""
        args = model.args
        dtype = model.tok_embeddings.weight.dtype
        self.model, self.device, self.max_len = model, device, max_len
        cache_slots = cache_slots if prefix_cache else 0
        self.cache = KVCache(args.n_layers, num_slots + cache_slots, args.n_kv_heads, max_len, args.head_dim, dtype,
                             device)
        self.model_runner = ModelRunner(model, self.cache, device=device, max_len=max_len, small_batch=small_batch,
                                        threads=threads, lora=lora, decode=decode)
        self.scheduler = Scheduler(num_slots, chunk_size, cache_slots=cache_slots, prefix_cache=prefix_cache)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.sampler = Sampler(args.vocab_size, tuple(eos_token_ids), device, seed)
        self._dirty: dict[Sequence, None] = {}  # sequences with something to report, in order
        self.num_prefill_forwards = 0  # observability (and the tests' spy)
        self.num_decode_forwards = 0
        self.current: list[Group] = []  # groups in the step under way (failed together on error)
        self._failures: list[tuple[str, BaseException]] = []  # requests failed alone in this step
        self.preparer: Preparer[Group] = Preparer()  # slow admissions, off the step loop
        self._populating: threading.Thread | None = None  # KVCache.populate ahead of the next copied prefix

    @property
    def lora(self) -> LoraManager | None:
        """The adapters, when the server has an adapters directory (the model runner binds them)."""
        return self.model_runner.lora

    # ---- requests --------------------------------------------------------------------------
    def add(self, request: GenerationRequest) -> Group:
        """Queue ``request`` now, preparing it on the caller's thread (raises the request's error)."""
        group = self._prepare(request)
        self.scheduler.add(group)
        return group

    def submit(self, request: GenerationRequest | None, request_id: str,
               build: Callable[[], GenerationRequest] | None = None) -> None:
        """Queue a request, given or built by ``build`` (unpickled, say); what may take long (building
        it, its plugin objects, loading its adapter) is done off the step loop, and the request is
        admitted by a later ``run_step``. Raises the request's error when it is prepared here."""
        if request is None or self._slow(request):
            def job() -> Group:
                return self._prepare(request if request is not None else build())  # type: ignore[misc]

            self.preparer.submit(request_id, job)
        else:
            self.add(request)

    def _slow(self, request: GenerationRequest) -> bool:
        return bool(request.guided is not None or request.logits_processors
                    or (request.adapter is not None and self.lora is not None
                        and not self.lora.is_loaded(request.adapter)))

    def _prepare(self, request: GenerationRequest) -> Group:
        self._check(request)
        group = Group.from_request(request)
        if request.adapter is not None:
            if self.lora is None:
                raise InvalidRequest("LoRA adapters are not enabled on this engine", param="peft")
            group.adapter = self.lora.get(request.adapter)
        p = request.sampling
        for seq in group.seqs:
            if p.seed is not None:
                seq.generator = self.sampler.new_generator(p.seed, seq.index)
            seq.processors = [factory() for factory in request.logits_processors]
            if request.guided is not None:
                seq.constraint = request.guided.new_state()
        if p.use_beam_search:
            end = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            group.beam = BeamState(group.num_slots, p.length_penalty, p.early_stopping,
                                   p.max_tokens, frozenset(end))
        return group

    def _admit_prepared(self) -> None:
        for rid, group, aborts in self.preparer.ready():
            if isinstance(group, BaseException):
                self._failures.append((rid, row_error("preparing the request", group)))
                continue
            try:
                self.scheduler.add(group)
            except Exception as exc:  # noqa: BLE001 - a duplicate id: this request's error
                self._failures.append((rid, row_error("queueing the request", exc)))
                continue
            for index in aborts:
                self.abort(rid, index)

    def _check(self, request: GenerationRequest) -> None:
        """Refuse (400) what would break a step: token ids outside the vocabulary, a prompt that
        does not fit, more sequences than slots."""
        prompt = request.prompt_token_ids
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if len(prompt) > self.max_len:
            raise InvalidRequest(f"the prompt has {len(prompt)} tokens; the engine's context is {self.max_len}",
                                 param="prompt")
        if max(1, request.n) > self.scheduler.num_slots:
            raise InvalidRequest(f"n={request.n} needs more than the engine's {self.scheduler.num_slots} sequence "
                                 "slots", param="n")
        vocab = self.sampler.vocab_size
        p = request.sampling
        for param, ids in (("prompt", prompt), ("stop_token_ids", p.stop_token_ids),
                           ("allowed_token_ids", p.allowed_token_ids or ()),
                           ("logit_bias", [t for t, _ in p.logit_bias])):
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                bad = next(t for t in ids if not 0 <= t < vocab)
                raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param=param)
        if p.allowed_token_ids is not None:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids) if p.min_tokens else set()
            if not set(p.allowed_token_ids) - banned:
                why = (" with min_tokens, which rules out EOS and the stop tokens until it is reached"
                       if p.allowed_token_ids else "")
                raise InvalidRequest(f"allowed_token_ids leaves no token to generate{why}", param="allowed_token_ids")

    def abort(self, request_id: str, index: int | None = None) -> list[Sequence]:
        if self.preparer.abort(request_id, index):
            return []
        seqs = self.scheduler.abort(request_id, index)
        for seq in seqs:
            if seq.group.beam is None:
                self._dirty[seq] = None
        return seqs

    def fail(self) -> list[str]:
        """After an exception in ``step``: drop the step's requests; return their ids."""
        ids = []
        for group in self.current:
            for seq in self.scheduler.abort(group.request_id):
                self._dirty.pop(seq, None)
            ids.append(group.request_id)
        self.current = []
        self.scheduler.prefix.clear()  # the failed step's writes, and its copies, may be partial
        return ids

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(running=s.num_running, waiting=s.num_waiting + len(self.preparer.pending),
                           slots_total=s.num_slots, slots_used=s.slots_used,
                           prefix_cache_hit_tokens=s.prefix.hit_tokens, prefix_cache_miss_tokens=s.prefix.miss_tokens)

    def run_step(self) -> tuple[list[SequenceOutput], list[tuple[str, BaseException]]]:
        """What a worker calls in its loop: a step if there is work, else what is still to report,
        with the requests that failed (each with its error). A request whose own work raised fails
        alone; a step that raises as a whole fails its requests, and the engine goes on."""
        if self.preparer.has_ready:
            self._admit_prepared()
        if not self.has_work:
            return self.drain(), self._take_failures()
        try:
            outputs = self.step()
        except Exception as exc:  # noqa: BLE001 - any failure of the model or sampler
            log.exception("engine step failed")
            failure = EngineError(f"engine step failed: {exc!r}")
            failed = self._take_failures()
            alone = {rid for rid, _ in failed}
            failed += [(rid, failure) for rid in self.fail() if rid not in alone]
            return self.drain(), failed
        return outputs, self._take_failures()

    def _fail(self, group: Group, exc: BaseException) -> None:
        """End ``group`` now with ``exc`` (its stream raises it); the rest of the step goes on."""
        if any(rid == group.request_id for rid, _ in self._failures):
            return
        log.warning("request %s failed in the engine: %r", group.request_id, exc)
        self.scheduler.abort(group.request_id)
        for seq in group.seqs:
            self._dirty.pop(seq, None)
        self._failures.append((group.request_id, exc))

    def _take_failures(self) -> list[tuple[str, BaseException]]:
        failures, self._failures = self._failures, []
        return failures

    # ---- the step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[SequenceOutput]:
        plan = self.scheduler.schedule()
        self.current = [c.group for c in plan.prefill] + list({s.group: None for s in plan.decode})
        for src, dst, length in plan.copies:  # cached prefixes, before anything writes this step
            self.cache.copy_slot(src, [dst], length)
        if plan.prefill:
            self._prefill(plan.prefill)
        if plan.decode:
            self._decode(plan.decode)
        self.current = []
        if not plan.prefill:  # never beside a prefill: a first token is waiting on it
            self._populate_ahead()
        return self.drain()

    def _populate_ahead(self) -> None:
        """Fault in, on a thread of its own, the slot the next cached prefix would be copied to, as far as such
        a copy could reach (``KVCache.populate``), so that a new request's copy finds its pages there."""
        if self.device.type != "cpu" or (self._populating is not None and self._populating.is_alive()):
            return
        target = self.scheduler.next_copy_target()
        if target is None:
            return
        slot, length = target
        length = min(-(-length // POPULATE_GRANULE) * POPULATE_GRANULE, self.max_len)  # a thread per granule
        if length > self.cache.populated[slot]:
            self._populating = threading.Thread(target=self.cache.populate, args=(slot, length), daemon=True,
                                                name="trtserver-kv-populate")
            self._populating.start()

    def _prefill(self, chunks: list[PrefillChunk]) -> None:
        hidden = self.model_runner.prefill(chunks)  # (B, T, dim)
        self.num_prefill_forwards += 1

        last_rows: list[Tensor] = []
        finishing: list[Group] = []
        for b, c in enumerate(chunks):
            group, n = c.group, c.end - c.start
            if group.prompt_token_logprobs is not None:
                try:
                    self._prompt_logprobs(group, c, self.model.logits(hidden[b, :n]))
                except Exception as exc:  # noqa: BLE001 - this request's scoring, not the batch's
                    self._fail(group, row_error("scoring the prompt", exc))
                    continue
            self.scheduler.prefilled(c)
            if c.last:
                finishing.append(group)
                last_rows.append(hidden[b, n - 1])
        if finishing:
            logits = self.model.logits(torch.stack(last_rows))  # (G, V)
            self._start_groups(finishing, logits)

    def _prompt_logprobs(self, group: Group, c: PrefillChunk, logits: Tensor) -> None:
        """Logits at positions start..end-1 score prompt tokens start+1..end (those that exist)."""
        prompt = group.request.prompt_token_ids
        n = min(c.end, len(prompt) - 1) - c.start
        if n <= 0:
            return
        logprobs = torch.log_softmax(logits[:n], dim=-1)  # (n, V)
        targets = torch.tensor(prompt[c.start + 1:c.start + 1 + n], device=logprobs.device)
        assert group.prompt_token_logprobs is not None and group.prompt_top_logprobs is not None
        group.prompt_token_logprobs += logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        k = group.request.sampling.prompt_logprobs or 0
        if k:
            values, indices = logprobs.topk(k, dim=-1)
            group.prompt_top_logprobs += [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
        else:
            group.prompt_top_logprobs += [[] for _ in range(n)]

    def _start_groups(self, groups: list[Group], logits: Tensor) -> None:
        """Prompts done: share the prefill with the other slots and take each first token."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        for g, group in enumerate(groups):
            live = [s for s in group.seqs if not s.finished]
            if group.request.sampling.max_tokens == 0 or group.prompt_len >= self.max_len:
                for seq in live:
                    if seq.slot != group.prefill_slot:
                        seq.num_cached = 0  # the prompt was never copied to its slot
                    self._finish(seq, "length")
                continue
            self.cache.copy_slot(group.prefill_slot, [s.slot for s in live if s.slot != group.prefill_slot],
                                 group.prompt_len)
            if group.beam is not None:
                self._guarded_beam_step(group, logits[g:g + 1].expand(len(live), -1).clone(), first=True)
                continue
            rows += [g] * len(live)
            seqs += live
        if seqs:
            self._sample(logits[rows], seqs)

    def _decode(self, seqs: list[Sequence]) -> None:
        logits = self.model_runner.decode(seqs)  # (B, V)
        self.num_decode_forwards += 1
        for seq in seqs:
            seq.num_cached += 1
        if not any(s.group.beam is not None for s in seqs):
            self._sample(logits, seqs)
            return
        plain = [i for i, s in enumerate(seqs) if s.group.beam is None]
        if plain:
            self._sample(logits[plain], [seqs[i] for i in plain])
        beams: dict[Group, list[int]] = {}
        for i, s in enumerate(seqs):
            if s.group.beam is not None:
                beams.setdefault(s.group, []).append(i)
        for group, idx in beams.items():
            self._guarded_beam_step(group, logits[idx], first=False)

    # ---- after the model ---------------------------------------------------------------------
    def _sample(self, logits: Tensor, seqs: list[Sequence]) -> None:
        result = self.sampler.sample(logits, seqs)
        failed = result.failed
        if failed:
            for i, exc in failed.items():
                self._fail(seqs[i].group, exc)
        for i, (seq, token) in enumerate(zip(seqs, result.token_ids)):
            if failed and seq.finished:  # its request failed in this step
                continue
            seq.output_ids.append(token)
            seq.pending_ids.append(token)
            p = seq.params
            if result.logprobs is not None:
                seq.cumulative_logprob += result.logprobs[i]
                if p.logprobs is not None:
                    seq.pending_logprobs.append(result.logprobs[i])
                    seq.pending_top.append(result.top_logprobs[i] if result.top_logprobs else [])
            self._dirty[seq] = None
            if seq.constraint is not None:
                try:
                    seq.constraint.accept_token(token)
                    terminated = seq.constraint.is_terminated()
                except Exception as exc:  # noqa: BLE001 - a plugin's guide: its request fails alone
                    self._fail(seq.group, row_error("the guided decoder", exc))
                    failed = failed or {i: exc}
                    continue
                if terminated:
                    self._finish(seq, "stop")
                    continue
            if token in p.stop_token_ids:
                seq.stop_token_id = token
                self._finish(seq, "stop")
            elif token in self.eos_token_ids and not p.ignore_eos:
                self._finish(seq, "stop")
            elif len(seq.output_ids) >= p.max_tokens or seq.total_len >= self.max_len:
                self._finish(seq, "length")

    def _guarded_beam_step(self, group: Group, logits: Tensor, first: bool) -> None:
        try:
            self._beam_step(group, logits, first)
        except Exception as exc:  # noqa: BLE001 - this request's search, not the batch's
            self._fail(group, row_error("beam search", exc))

    def _beam_step(self, group: Group, logits: Tensor, first: bool) -> None:
        beam = group.beam
        assert beam is not None
        seqs = group.seqs
        failed: dict[int, BaseException] = {}
        logits = self.sampler.process(logits, seqs, failed)
        if failed:
            raise next(iter(failed.values()))
        logprobs = torch.log_softmax(logits, dim=-1)  # (W, V)
        at_limit = seqs[0].total_len + 1 >= self.max_len
        if first:
            beam.sums = [0.0] * beam.width
        picks = beam.step([s.output_ids for s in seqs], logprobs, first, at_limit)
        if beam.done:
            for seq, hyp in zip(seqs, beam.hyps):
                seq.output_ids = hyp.token_ids
                seq.pending_ids = list(hyp.token_ids)
                seq.cumulative_logprob = hyp.score
                self._finish(seq, hyp.finish_reason)
            for seq in seqs[len(beam.hyps):]:
                self._finish(seq, "length")
            return
        while len(picks) < beam.width:  # only if nearly every candidate ended: repeat the best
            picks.append(picks[0])
            beam.sums.append(beam.sums[0])
        outputs = [s.output_ids for s in seqs]
        self.cache.reorder([s.slot for s in seqs], [seqs[p].slot for p, _ in picks], seqs[0].num_cached)
        for seq, (parent, token) in zip(seqs, picks):
            seq.output_ids = outputs[parent] + [token]

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self._dirty[seq] = None

    def drain(self) -> list[SequenceOutput]:
        """Deltas for everything that changed since the last call."""
        out = []
        for seq in self._dirty:
            group = seq.group
            if group.beam is not None and not group.finished and seq.finish_reason != "abort":
                continue
            p = seq.params
            delta = SequenceOutput(
                request_id=group.request_id, index=seq.index, token_ids=seq.pending_ids,
                finish_reason=seq.finish_reason, stop_token_id=seq.stop_token_id,
                cumulative_logprob=seq.cumulative_logprob, num_prompt_tokens=group.prompt_len,
                num_cached_tokens=group.cached_tokens,
            )
            if p.logprobs is not None and group.beam is None:
                delta.logprobs, delta.top_logprobs = seq.pending_logprobs, seq.pending_top
                seq.pending_logprobs, seq.pending_top = [], []
            if seq.index == 0 and not group.prompt_sent and group.prompt_token_logprobs is not None \
                    and group.prefill_done:
                delta.prompt_token_logprobs = group.prompt_token_logprobs
                delta.prompt_logprobs = group.prompt_top_logprobs
                group.prompt_sent = True
            seq.pending_ids = []
            out.append(delta)
        self._dirty.clear()
        return out
