"""The batched sampler on small hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support import AllowedTokens
from trtserver.engine.base import GenerationRequest, SamplingParams
from trtserver.engine.torch.sampler import Sampler
from trtserver.engine.torch.sequence import Group, Sequence

V = 8
EOS = 7


def seq(output: list[int] | None = None, prompt: list[int] | None = None, index: int = 0, **params: object) -> Sequence:
    g = Group.from_request(GenerationRequest("r", prompt or [0], SamplingParams(**params), n=index + 1))  # type: ignore[arg-type]
    s = g.seqs[index]
    s.output_ids = list(output or [])
    return s


@pytest.fixture
def sampler() -> Sampler:
    return Sampler(V, (EOS,), torch.device("cpu"), seed=0)


def logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def flat() -> list[float]:
    return [0.0] * V


def draws(sampler: Sampler, row: list[float], s: Sequence, n: int = 200) -> set[int]:
    return {sampler.sample(logits(row), [s]).token_ids[0] for _ in range(n)}


def test_greedy_is_argmax(sampler: Sampler) -> None:
    out = sampler.sample(logits([0, 1, 5, 2, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0, 0, 0]),
                         [seq(temperature=0.0), seq(temperature=0.0)])
    assert out.token_ids == [2, 0] and out.logprobs is None


def test_top_k_top_p_min_p_masking(sampler: Sampler) -> None:
    row = [4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]
    assert draws(sampler, row, seq(top_k=2)) == {0, 1}
    # probabilities of row: 0.64, 0.23, 0.09, ... -> top_p=0.8 keeps tokens 0 and 1
    assert draws(sampler, row, seq(top_p=0.8)) == {0, 1}
    assert draws(sampler, row, seq(top_p=0.5)) == {0}
    # min_p=0.1: keep tokens with p >= 0.1 * 0.64 -> 0, 1, 2
    assert draws(sampler, row, seq(min_p=0.1)) == {0, 1, 2}
    assert draws(sampler, flat(), seq()) == set(range(V))


def test_mixed_batch_applies_each_rows_own_parameters(sampler: Sampler) -> None:
    row = [4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]
    rows = [seq(top_k=1), seq(temperature=0.0), seq(top_k=3, top_p=0.9)]
    seen: list[set[int]] = [set(), set(), set()]
    for _ in range(100):
        for i, t in enumerate(sampler.sample(logits(row, row[::-1], row), rows).token_ids):
            seen[i].add(t)
    assert seen[0] == {0} and seen[1] == {7} and seen[2] <= {0, 1, 2}


def test_temperature_flattens_and_sharpens(sampler: Sampler) -> None:
    row = [2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    hot = sum(t == 0 for t in (sampler.sample(logits(row), [seq(temperature=5.0)]).token_ids[0] for _ in range(300)))
    cold = sum(t == 0 for t in (sampler.sample(logits(row), [seq(temperature=0.2)]).token_ids[0] for _ in range(300)))
    assert cold > 290 and hot < 150


def test_penalties(sampler: Sampler) -> None:
    row = [1.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    out = sampler.process(logits(row), [seq(output=[0, 0, 2], frequency_penalty=0.5)])[0]
    assert out[:3].tolist() == [0.0, 1.0, -1.5]
    out = sampler.process(logits(row), [seq(output=[0, 0, 2], presence_penalty=0.5)])[0]
    assert out[:3].tolist() == [0.5, 1.0, -1.5]
    # repetition: prompt and output tokens; positive logits divided, negative multiplied
    out = sampler.process(logits(row), [seq(output=[2], prompt=[1], repetition_penalty=2.0)])[0]
    assert out[:3].tolist() == [1.0, 0.5, -2.0]


def test_logit_bias_and_allowed_token_ids(sampler: Sampler) -> None:
    assert sampler.sample(logits(flat()), [seq(logit_bias=((5, 100.0),))]).token_ids == [5]
    banned = {sampler.sample(logits(flat()), [seq(logit_bias=((3, -100.0),))]).token_ids[0] for _ in range(200)}
    assert 3 not in banned
    assert draws(sampler, flat(), seq(allowed_token_ids=(2, 4))) == {2, 4}


def test_min_tokens_masks_eos_and_stop_tokens_until_reached(sampler: Sampler) -> None:
    row = [0.0] * (V - 2) + [50.0, 50.0]  # token 6 (a stop token) and 7 (EOS) dominate
    assert draws(sampler, row, seq(output=[1], min_tokens=2, stop_token_ids=(6,)), 50) & {6, 7} == set()
    assert draws(sampler, row, seq(output=[1, 1], min_tokens=2, stop_token_ids=(6,)), 50) <= {6, 7}
    # ignore_eos: EOS is not a stop, so min_tokens leaves it alone
    assert 7 in draws(sampler, row, seq(output=[], min_tokens=2, ignore_eos=True), 50)


def test_seeded_rows_repeat_whatever_the_batch(sampler: Sampler) -> None:
    def run(batch_extra: int) -> list[int]:
        s = seq(seed=1234)
        s.generator = sampler.new_generator(1234, 0)
        others = [seq() for _ in range(batch_extra)]
        got = []
        for _ in range(20):
            rows = [*others, s]
            got.append(sampler.sample(logits(*[flat()] * len(rows)), rows).token_ids[-1])
        return got

    assert run(0) == run(3)
    a, b = sampler.new_generator(1234, 0), sampler.new_generator(1234, 1)
    assert torch.rand(4, generator=a).tolist() != torch.rand(4, generator=b).tolist()


def test_logprobs_are_of_the_processed_distribution_before_temperature(sampler: Sampler) -> None:
    row = [2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    out = sampler.sample(logits(row), [seq(temperature=0.0, logprobs=2, logit_bias=((1, 1.0),))])
    expected = torch.log_softmax(torch.tensor([2.0, 2.0, 0, 0, 0, 0, 0, 0]), dim=-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    assert math.isclose(out.logprobs[0], expected[0].item(), rel_tol=1e-6)
    assert [t for t, _ in out.top_logprobs[0]] in ([0, 1], [1, 0]) and len(out.top_logprobs[0]) == 2
    out = sampler.sample(logits(row), [seq(temperature=3.0, logprobs=0)])
    assert out.top_logprobs == [[]] and out.logprobs is not None
    assert math.isclose(math.exp(out.logprobs[0]),
                        torch.softmax(torch.tensor(row), -1)[out.token_ids[0]].item(), rel_tol=1e-5)



def test_bitmask_rows_apply_in_one_op() -> None:
    vocab = 70  # three words per row, last one partial
    sampler = Sampler(vocab, (1,), torch.device("cpu"), seed=0)
    a, c = seq(), seq()
    a.constraint, c.constraint = AllowedTokens({3, 33, 69}), AllowedTokens({64})
    rows = [a, seq(), c]
    mask = sampler.fill_bitmask(rows)
    assert mask.shape == (3, 3) and mask.dtype == torch.int32
    out = torch.zeros(3, vocab)
    sampler.apply_bitmask(out, mask)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [3, 33, 69]
    assert torch.isfinite(out[1]).all()
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [64]
    seen = {tuple(sampler.sample(torch.zeros(3, vocab), rows).token_ids[::2]) for _ in range(50)}
    assert {t for t, _ in seen} <= {3, 33, 69} and {t for _, t in seen} == {64}


def test_top_k_keeps_exactly_k_with_ties_broken_as_greedy(sampler: Sampler) -> None:
    tie = [1.0, 5.0, 5.0, 0.0, 5.0, 0.0, 0.0, 0.0]  # tokens 1, 2 and 4 tie for the top
    greedy = sampler.sample(logits(tie), [seq(temperature=0.0)]).token_ids[0]
    assert greedy == 1  # argmax takes the lowest id
    assert draws(sampler, tie, seq(top_k=1)) == {greedy}
    assert draws(sampler, tie, seq(top_k=1, temperature=0.7)) == {greedy}
    assert draws(sampler, tie, seq(top_k=2)) == {1, 2}
    # a tie at the k-th place: the lower ids make up the k
    assert draws(sampler, [9.0, 5.0, 0.0, 5.0, 5.0, 0.0, 0.0, 0.0], seq(top_k=3)) == {0, 1, 3}
    # rows with and without top-k in one batch
    rows = [seq(top_k=1), seq(), seq(top_k=2)]
    seen: list[set[int]] = [set(), set(), set()]
    for _ in range(100):
        for i, t in enumerate(sampler.sample(logits(tie, flat(), tie), rows).token_ids):
            seen[i].add(t)
    assert seen[0] == {1} and seen[1] == set(range(V)) and seen[2] == {1, 2}


def test_a_tiny_top_p_is_greedy_also_on_a_tie(sampler: Sampler) -> None:
    tie = [0.0, 0.0, 3.0, 0.0, 0.0, 3.0, 3.0, 0.0]
    greedy = sampler.sample(logits(tie), [seq(temperature=0.0)]).token_ids[0]
    assert greedy == 2
    assert draws(sampler, tie, seq(top_p=1e-6)) == {greedy}
    assert draws(sampler, tie, seq(top_p=1e-6, temperature=2.0)) == {greedy}
    assert draws(sampler, tie, seq(top_p=1e-6, top_k=5)) == {greedy}
    # the nucleus grows along greedy's order: the tied tokens by id
    assert draws(sampler, tie, seq(top_p=0.34)) == {2, 5}


def test_a_row_with_no_allowed_token_fails_alone(sampler: Sampler) -> None:
    from trtserver.errors import InvalidRequest

    rows = [seq(allowed_token_ids=(EOS,), min_tokens=2), seq(temperature=0.0), seq()]
    rows[2].constraint = AllowedTokens(())
    out = sampler.sample(logits([1.0] * V, [0, 0, 9, 0, 0, 0, 0, 0], flat()), rows)
    assert set(out.failed) == {0, 2} and out.token_ids[1] == 2
    assert isinstance(out.failed[0], InvalidRequest) and out.failed[0].param == "allowed_token_ids"
    assert isinstance(out.failed[2], InvalidRequest) and out.failed[2].param == "guided"
    # once min_tokens is reached, EOS is allowed again
    assert not sampler.sample(logits(flat()), [seq(output=[1, 1], allowed_token_ids=(EOS,), min_tokens=2)]).failed
