"""One request's failure stays its own: the others in the same engine step go on, token for token.

A bad request here is one whose values (beam search's length penalty, stop tokens covering the
vocabulary, token ids outside it) or whose plugin objects (a logits processor or guide that raises)
break the step it runs in. Each runs beside a greedy request that must produce exactly the tokens
it produces alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from tests.support import AllowedTokens
from trtserver.engine.base import GenerationRequest, SamplingParams, SequenceOutput
from trtserver.engine.torch.engine import TorchEngine
from trtserver.errors import EngineError, InvalidRequest

_ids = iter(range(10**9))
GOOD_PROMPT = "Once upon a time, a small robot"
GOOD_TOKENS = 24


async def run(engine: TorchEngine, request: GenerationRequest) -> list[SequenceOutput]:
    return [d async for d in engine.generate(request)]


def good_request() -> GenerationRequest:
    # seeded: no cached prefix (its shorter prefill may round a near tie apart) sets it apart from `alone`
    return GenerationRequest(f"good{next(_ids)}", [], SamplingParams(max_tokens=GOOD_TOKENS, temperature=0.0,
                                                                      ignore_eos=True, seed=0))


async def good_tokens(engine: TorchEngine, started: asyncio.Event | None = None) -> list[int]:
    request = good_request()
    request.prompt_token_ids = engine.tokenizer.encode(GOOD_PROMPT)
    tokens: list[int] = []
    async for delta in engine.generate(request):
        tokens += delta.token_ids
        if started is not None and len(tokens) >= 2:
            started.set()
    return tokens


Outcome = list[SequenceOutput] | BaseException


async def beside_good(engine: TorchEngine, bad: GenerationRequest) -> tuple[list[int], Outcome]:
    """Run ``bad`` while a greedy request decodes (started first, so they share decode steps)."""
    started = asyncio.Event()
    good = asyncio.create_task(good_tokens(engine, started))
    await asyncio.wait_for(started.wait(), 60)
    try:
        outcome: Outcome = await run(engine, bad)
    except Exception as exc:  # noqa: BLE001 - what the bad request's stream raised
        outcome = exc
    return await good, outcome


@pytest.fixture(scope="module")
def alone(engine: TorchEngine) -> list[int]:
    return asyncio.run(good_tokens(engine))


def request(engine: TorchEngine, **params: Any) -> GenerationRequest:
    n = params.pop("n", 1)
    return GenerationRequest(f"bad{next(_ids)}", engine.tokenizer.encode("The capital of France is"),
                             SamplingParams(**params), n=n)


class RaisesAfter:
    """A logits processor that raises on its ``calls``-th call."""

    def __init__(self, calls: int) -> None:
        self.calls = calls

    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> None:
        self.calls -= 1
        if self.calls <= 0:
            raise RuntimeError("processor broke")


class BrokenGuide(AllowedTokens):
    """A guide whose mask raises once a few tokens were accepted."""

    def new_state(self) -> BrokenGuide:
        return BrokenGuide(self.allowed)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if len(self.accepted) >= 2:
            raise RuntimeError("guide broke")
        super().fill_bitmask(bitmask, row)


class AcceptRaises(AllowedTokens):
    def new_state(self) -> AcceptRaises:
        return AcceptRaises(self.allowed)

    def accept_token(self, token_id: int) -> bool:
        raise RuntimeError("accept broke")


BEAM: dict[str, Any] = dict(use_beam_search=True, temperature=0.0, max_tokens=5)


@pytest.mark.parametrize("params", [
    dict(length_penalty=1e308), dict(length_penalty=-1000.0), dict(length_penalty=1e300, early_stopping="never"),
    dict(length_penalty=float("inf")), dict(length_penalty=-1e308, early_stopping=True),
], ids=["lp-huge", "lp-very-negative", "never-lp-huge", "lp-inf", "lp-minus-huge"])
async def test_beam_search_survives_extreme_length_penalties(engine: TorchEngine, alone: list[int],
                                                             params: dict[str, Any]) -> None:
    good, outcome = await beside_good(engine, request(engine, n=2, **BEAM, **params))
    assert good == alone
    assert not isinstance(outcome, BaseException), outcome
    assert sorted(d.index for d in outcome) == [0, 1]
    assert all(d.finish_reason in ("stop", "length") and d.token_ids for d in outcome)


async def test_beam_search_with_every_token_a_stop_token(engine: TorchEngine, alone: list[int]) -> None:
    vocab = engine.info.vocab_size
    good, outcome = await beside_good(engine, request(engine, n=3, stop_token_ids=tuple(range(vocab)), **BEAM))
    assert good == alone
    assert not isinstance(outcome, BaseException), outcome
    assert sorted(d.index for d in outcome) == [0, 1, 2]
    assert all(d.finish_reason == "stop" and len(d.token_ids) == 1 for d in outcome)


async def test_sampling_with_every_token_a_stop_token(engine: TorchEngine, alone: list[int]) -> None:
    vocab = engine.info.vocab_size
    good, outcome = await beside_good(engine, request(engine, max_tokens=4, temperature=0.0,
                                                      stop_token_ids=tuple(range(vocab))))
    assert good == alone
    assert not isinstance(outcome, BaseException), outcome
    assert [d.finish_reason for d in outcome] == ["stop"] and len(outcome[0].token_ids) == 1


@pytest.mark.parametrize("field", ["stop_token_ids", "allowed_token_ids", "logit_bias"])
async def test_token_ids_outside_the_vocabulary_are_the_requests_400(engine: TorchEngine, alone: list[int],
                                                                     field: str) -> None:
    bad_id = engine.info.vocab_size + 5
    value: object = ((bad_id, 1.0),) if field == "logit_bias" else (bad_id,)
    extra: dict[str, Any] = dict(min_tokens=3) if field == "stop_token_ids" else {}
    good, outcome = await beside_good(engine, request(engine, max_tokens=4, **{field: value}, **extra))
    assert good == alone
    assert isinstance(outcome, InvalidRequest) and outcome.param == field, outcome


@pytest.mark.parametrize("beam", [False, True], ids=["sampled", "beam"])
async def test_a_raising_logits_processor_fails_only_its_request(engine: TorchEngine, alone: list[int],
                                                                 beam: bool) -> None:
    bad = request(engine, n=2 if beam else 1, **{**(BEAM if beam else {}), "max_tokens": 8})
    bad.logits_processors = (lambda: RaisesAfter(3),)
    good, outcome = await beside_good(engine, bad)
    assert good == alone
    assert isinstance(outcome, EngineError) and "processor broke" in outcome.message, outcome


@pytest.mark.parametrize("guide", [BrokenGuide, AcceptRaises])
async def test_a_raising_guide_fails_only_its_request(engine: TorchEngine, alone: list[int],
                                                      guide: type[AllowedTokens]) -> None:
    bad = request(engine, max_tokens=8, temperature=1.0)
    bad.guided = guide(range(100, 200))
    good, outcome = await beside_good(engine, bad)
    assert good == alone
    assert isinstance(outcome, EngineError) and "broke" in outcome.message, outcome


async def test_several_bad_requests_in_one_step(engine: TorchEngine, alone: list[int]) -> None:
    """Two failing requests and two good ones, all in the same steps."""
    bad = [request(engine, max_tokens=8) for _ in range(2)]
    for r in bad:
        r.logits_processors = (lambda: RaisesAfter(2),)
    started = asyncio.Event()
    goods = [asyncio.create_task(good_tokens(engine, started)) for _ in range(2)]
    await asyncio.wait_for(started.wait(), 60)
    outcomes = await asyncio.gather(*(run(engine, r) for r in bad), return_exceptions=True)
    assert [await g for g in goods] == [alone, alone]
    assert all(isinstance(o, EngineError) for o in outcomes), outcomes
    for _ in range(200):
        if engine.stats().slots_used == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.stats().slots_used == 0


# ---- constraints that leave no token: an error for that request, never a forbidden token ----------

async def test_allowed_token_ids_all_ruled_out_by_min_tokens_is_a_400(engine: TorchEngine, alone: list[int]) -> None:
    eos = engine.info.eos_token_ids[0]
    good, outcome = await beside_good(engine, request(engine, min_tokens=5, allowed_token_ids=(eos,), max_tokens=8))
    assert good == alone
    assert isinstance(outcome, InvalidRequest) and outcome.param == "allowed_token_ids", outcome
    assert "min_tokens" in outcome.message


class MasksEverything:
    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> None:
        if len(output_token_ids) >= 2:
            logits.fill_(float("-inf"))


@pytest.mark.parametrize("case", ["empty-guide", "guide-only-eos-under-min-tokens", "processor-masks-all",
                                  "allowed-with-processor"])
async def test_no_allowed_token_ends_the_request_with_an_error(engine: TorchEngine, alone: list[int],
                                                               case: str) -> None:
    eos = engine.info.eos_token_ids[0]
    if case == "empty-guide":
        bad = request(engine, max_tokens=6, temperature=1.0)
        bad.guided, param = AllowedTokens(()), "guided"
    elif case == "guide-only-eos-under-min-tokens":
        bad = request(engine, max_tokens=6, temperature=0.0, min_tokens=3)
        bad.guided, param = AllowedTokens((eos,)), "guided"
    elif case == "processor-masks-all":
        bad = request(engine, max_tokens=6, temperature=0.7, seed=1)
        bad.logits_processors, param = (MasksEverything,), None
    else:
        bad = request(engine, max_tokens=6, temperature=0.0, allowed_token_ids=(100, 200))
        bad.logits_processors, param = (MasksEverything,), "allowed_token_ids"
    emitted: list[int] = []

    async def consume() -> None:
        async for delta in engine.generate(bad):
            emitted.extend(delta.token_ids)

    started = asyncio.Event()
    good_task = asyncio.create_task(good_tokens(engine, started))
    await asyncio.wait_for(started.wait(), 60)
    with pytest.raises(InvalidRequest) as err:
        await consume()
    assert err.value.param == param and "allow" in err.value.message, err.value
    assert await good_task == alone
    if case.startswith("processor") or case.startswith("allowed"):
        assert len(emitted) == 2 and (case != "allowed-with-processor" or set(emitted) <= {100, 200})
    else:
        assert emitted == []
