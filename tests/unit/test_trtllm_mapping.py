"""The mapping table: its cells agree with the run-time refusals on every stand-in, and the doc is current."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.standins import harness
from tests.support import AllowedTokens
from trtserver.engine.base import GenerationRequest, Priority, SamplingParams, SequenceOutput
from trtserver.engine.trtllm.mapping import RULES, Kind, refusals, render_markdown, splice_doc
from trtserver.engine.trtllm.stream import StreamTranslator, split_logprob
from trtserver.engine.trtllm.version import Generation, detect

standin = harness.standin

DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"


@dataclass
class Guide:
    spec: Any = None
    backend: str | None = "outlines"

    def new_state(self) -> Any:
        return None


def req(n: int = 1, **kw: Any) -> GenerationRequest:
    extra = {k: kw.pop(k) for k in ("priority", "adapter", "guided", "logits_processors") if k in kw}
    return GenerationRequest("r", [2, 3], SamplingParams(**kw), n=n, **extra)


# one request per rule that uses the field beyond its default
ACTIVATE: dict[str, GenerationRequest] = {
    "min_p": req(min_p=0.1),
    "ignore_eos": req(ignore_eos=True),
    "logit_bias": req(logit_bias=((3, 1.0),)),
    "logprobs": req(logprobs=0),
    "prompt_logprobs": req(prompt_logprobs=1),
    "n": req(n=2),
    "use_beam_search": req(n=2, use_beam_search=True),
    "priority": req(priority=Priority.HIGH),
    "peft": req(adapter="a"),
    "guided_json": req(guided=Guide()),
    "logits_processors": req(logits_processors=[lambda: None]),
}

STANDIN_GEN = [
    ("v1", True, Generation.V1_ENGINE),
    ("v1", False, Generation.V1_PYTORCH),
    ("v0", True, Generation.V0),
    ("jetson", True, Generation.JETSON),
]


@pytest.mark.parametrize(("name", "engine", "generation"), STANDIN_GEN)
def test_cells_agree_with_refusals(
    standin: Any, monkeypatch: pytest.MonkeyPatch, name: str, engine: bool, generation: Generation
) -> None:
    monkeypatch.setattr("trtserver.engine.trtllm.version.on_tegra", lambda: True)
    f = detect(standin(name), has_engine=engine).with_options(guided_backend="xgrammar", lora_enabled=True)
    assert f.generation is generation
    for rule in RULES:
        cell = rule.cell(generation)
        if rule.check is None:
            assert cell.kind in (Kind.OURS, Kind.NATIVE), rule.field
            continue
        r = ACTIVATE[rule.param]
        refused = [p for p, _ in refusals(r, f) if p == rule.param]
        if cell.kind is Kind.REFUSED:
            assert refused, (rule.field, generation)
        elif cell.kind in (Kind.NATIVE, Kind.OURS):
            assert not refused, (rule.field, generation, refusals(r, f))


def test_specific_refusals(standin: Any) -> None:
    f = detect(standin("v1"), has_engine=True)
    assert refusals(req(prompt_logprobs=1), f)[0][0] == "prompt_logprobs"
    built = f.with_options(build=type(f.build)(gather_context_logits=True))
    assert refusals(req(prompt_logprobs=1), built) == []
    assert refusals(req(priority=Priority.LOW), f)[0] == (
        "priority",
        refusals(req(priority=Priority.LOW), f)[0][1],
    )
    assert "1.4" in refusals(req(priority=Priority.LOW), f)[0][1]
    # guided with a non-xgrammar backend goes through our logits processor: fine on 1.x
    assert refusals(req(guided=Guide()), f) == []
    assert (
        refusals(
            req(guided=Guide(), n=2, use_beam_search=True),
            f.with_options(build=type(f.build)(max_beam_width=4)),
        )[0][0]
        == "guided_json"
    )


def test_every_request_field_is_in_the_table() -> None:
    from trtserver.protocol import REQUEST_FIELDS

    named = {part.strip("`() ").split(" ")[0] for rule in RULES for part in rule.field.split(" / ")}
    named |= {"echo+logprobs", "loglikelihood", "logits_processors", "peft", "response_format"}
    assert REQUEST_FIELDS - named == set()


def test_doc_matches_code() -> None:
    text = DOC.read_text()
    assert render_markdown() in text
    assert splice_doc(text) == text


# --- stream translation on plain objects --------------------------------------------------------


@dataclass
class Out:
    index: int = 0
    token_ids: list[int] = None  # type: ignore[assignment]
    logprobs: list[Any] = None  # type: ignore[assignment]
    finish_reason: str | None = None
    stop_reason: Any = None
    cumulative_logprob: float | None = None


@dataclass
class RO:
    outputs: list[Out]
    finished: bool = False


def translator(
    n: int = 1, *, our: frozenset[int] = frozenset(), finish: bool = True, **kw: Any
) -> StreamTranslator:
    return StreamTranslator(
        req(n=n, **kw),
        eos_ids=(1, 2),
        our_stop_ids=our,
        max_tokens=kw.get("max_tokens", 16),
        has_finish_reason=finish,
    )


def test_cumulative_tokens_and_stop_reason() -> None:
    t = translator(stop_token_ids=(9,))
    o = Out(token_ids=[5])
    assert [d.token_ids for d in t.step(RO([o]))] == [[5]]
    o.token_ids += [6, 9]
    o.finish_reason, o.stop_reason = "stop", 9
    (d,) = t.step(RO([o], finished=True))
    assert (d.token_ids, d.finish_reason, d.stop_token_id) == ([6, 9], "stop", 9)
    assert t.finished


def test_finish_mapping_and_eos_stop_reason() -> None:
    for raw, ours in (("length", "length"), ("cancelled", "abort"), ("timeout", "abort")):
        t = translator()
        (d,) = t.step(RO([Out(token_ids=[5], finish_reason=raw)], finished=True))
        assert d.finish_reason == ours
    t = translator()
    (d,) = t.step(RO([Out(token_ids=[5, 2], finish_reason="stop", stop_reason=2)], finished=True))
    assert d.stop_token_id is None  # an EOS id, not a client stop id


def test_no_finish_reason_version_infers() -> None:
    t = translator(finish=False, max_tokens=3)
    (d,) = t.step(RO([Out(token_ids=[5, 6, 7])], finished=True))
    assert d.finish_reason == "length"
    t = translator(finish=False, max_tokens=3)
    (d,) = t.step(RO([Out(token_ids=[5, 1])], finished=True))
    assert (d.finish_reason, d.stop_token_id) == ("stop", None)


def test_our_stop_ids_cut_the_stream() -> None:
    t = translator(our=frozenset({7}), finish=False)
    (d,) = t.step(RO([Out(token_ids=[5, 7, 8])]))
    assert (d.token_ids, d.finish_reason, d.stop_token_id) == ([5, 7], "stop", 7)
    assert t.step(RO([Out(token_ids=[5, 7, 8, 9])], finished=True)) == []


def test_logprob_shapes() -> None:
    @dataclass
    class LP:
        logprob: float
        rank: int | None = None

    assert split_logprob(-0.5, 3, 2) == (-0.5, None)
    chosen, top = split_logprob({3: LP(-1.0, 2), 4: LP(-0.1, 1), 5: LP(-3.0, 3)}, 3, 2)
    assert chosen == -1.0 and top == [(4, -0.1), (3, -1.0)]
    t = translator(logprobs=1)
    o = Out(token_ids=[5, 6], logprobs=[{5: LP(-0.2, 1)}, {6: LP(-0.3, 1)}])
    (d,) = t.step(RO([o]))
    assert d.logprobs == [-0.2, -0.3] and d.top_logprobs == [[(5, -0.2)], [(6, -0.3)]]
    o.token_ids.append(7)
    o.logprobs = [{7: LP(-0.4, 1)}]  # incremental form: only the newest
    (d,) = t.step(RO([o]))
    assert d.logprobs == [-0.4]


def test_beam_waits_for_the_end() -> None:
    t = translator(n=2, use_beam_search=True)
    assert t.step(RO([Out(0, [5]), Out(1, [6])])) == []
    out = t.step(
        RO(
            [
                Out(0, [5, 6], finish_reason="length", cumulative_logprob=-1.0),
                Out(1, [6, 7], finish_reason="length", cumulative_logprob=-2.0),
            ],
            finished=True,
        )
    )
    assert [(d.index, d.token_ids, d.cumulative_logprob) for d in out] == [
        (0, [5, 6], -1.0),
        (1, [6, 7], -2.0),
    ]


def test_missing_sequences_end_as_abort_on_final() -> None:
    t = translator(n=2)
    out = t.step(RO([Out(0, [5], finish_reason="cancelled")], finished=True))
    assert sorted((d.index, d.finish_reason) for d in out) == [(0, "abort"), (1, "abort")]
    assert all(isinstance(d, SequenceOutput) for d in out)


# --- our per-request logits processor --------------------------------------------------------------


class Guided:
    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed
        self.states: list[AllowedTokens] = []

    def new_state(self) -> AllowedTokens:
        self.states.append(AllowedTokens(self.allowed))
        return self.states[-1]


def test_logits_processor_masks_and_feeds_tokens() -> None:
    import torch

    from trtserver.engine.trtllm.logits import TrtllmLogitsProcessor

    guide = Guided({3, 40})
    calls: list[list[int]] = []
    proc = TrtllmLogitsProcessor(
        guided=guide,
        processors=[lambda: lambda ids, row: calls.append(list(ids))],
        logit_bias=((3, 1.0),),
        eos_ids=(1,),
    )
    logits = torch.zeros(1, 1, 70)
    proc(7, logits, [[2, 3]], None, None)  # the prompt (or nothing) on the first call
    assert torch.isinf(logits[0, 0, 0]) and logits[0, 0, 3] == 1.0 and logits[0, 0, 40] == 0.0
    assert torch.isinf(logits[0, 0, 69])  # padding beyond the vocabulary is masked too
    logits = torch.zeros(1, 1, 70)
    proc(7, logits, [[2, 3, 40]], None, None)
    assert guide.states[0].accepted == [40] and calls == [[], [40]]
    clone = pickle.loads(pickle.dumps(TrtllmLogitsProcessor(allowed_token_ids=(5,), eos_ids=(1,))))
    logits = torch.zeros(1, 1, 8)
    clone(1, logits, [[]], None, None)
    assert logits[0, 0, 5] == 0.0 and torch.isinf(logits[0, 0, 4])


def test_chat_fields_map_onto_rows_of_the_table() -> None:
    from trtserver.engine.trtllm.mapping import CHAT_FIELDS

    named = {part.strip() for rule in RULES for part in rule.field.split(" / ")}
    for chat, completions, _ in CHAT_FIELDS:
        if completions != "the same field":
            assert set(completions.split(" / ")) <= named, chat
    assert "| `max_completion_tokens / max_tokens` | `max_tokens` |" in render_markdown()
