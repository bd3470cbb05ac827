"""The faults found by reading TensorRT-LLM's own source, each against the stand-in of the version it
bites on (the stand-ins reproduce that source; see tests/standins/README.md)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.standins import harness
from tests.standins.harness import collect, finish, make_engine, request, tokens
from trtserver.config import ServerConfig

standin = harness.standin

PROMPT = [2, 3, 5, 9, 4]


def set_version(version: str) -> None:
    """Make the imported stand-in claim another release (it models what differs by release)."""
    setattr(sys.modules["tensorrt_llm"], "__version__", version)  # noqa: B010


def expected_prompt_logprobs(k: int) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """What a correct engine reports: row i-1 of the model's context logits scores prompt token i."""
    import standin_core
    import torch

    rows = torch.log_softmax(standin_core.context_logits(PROMPT, len(harness.VOCAB)), dim=-1)
    values: list[float | None] = [None]
    tops: list[list[tuple[int, float]] | None] = [None]
    for i in range(1, len(PROMPT)):
        values.append(float(rows[i - 1, PROMPT[i]]))
        top_v, top_i = rows[i - 1].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        tops.append([(int(t), float(v)) for t, v in zip(top_i, top_v, strict=True)])
    return values, tops


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize(("generation", "engine"), [("v1", True), ("v1", False)])
def test_prompt_logprobs_score_each_prompt_token_from_the_previous_position(
    standin: Any, tmp_path: Path, generation: str, engine: bool, k: int
) -> None:
    e = make_engine(standin, tmp_path, generation, engine=engine, build={"gather_context_logits": True})
    deltas = asyncio.run(collect(e, request(prompt=PROMPT, max_tokens=1, prompt_logprobs=k)))
    values, tops = expected_prompt_logprobs(k)
    got = deltas[0]
    assert got.prompt_token_logprobs == pytest.approx(values)
    assert got.prompt_logprobs is not None and got.prompt_logprobs[0] is None
    for have, want in zip(got.prompt_logprobs[1:], tops[1:], strict=True):
        assert have is not None and want is not None and [t for t, _ in have] == [t for t, _ in want]
        assert [v for _, v in have] == pytest.approx([v for _, v in want])


LORA_ENGINE = {
    "plugin_config": {"lora_plugin": "auto"},
    "lora_config": {
        "lora_target_modules": ["attn_q", "attn_k", "attn_v"],
        "trtllm_modules_to_hf_modules": {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj"},
        "max_lora_rank": 16,
    },
}


def adapters(tmp_path: Path) -> Path:
    root = tmp_path / "adapters"
    (root / "sql").mkdir(parents=True)
    return root


def test_lora_on_016_passes_the_flat_llm_args(standin: Any, tmp_path: Path) -> None:
    """0.14-0.18: LlmArgs is a dataclass with enable_lora/max_lora_rank/max_loras/max_cpu_loras and no
    lora_config; LoraConfig has no max_loras."""
    e = make_engine(standin, tmp_path, "v0", adapters_dir=str(adapters(tmp_path)), build=LORA_ENGINE)
    asyncio.run(collect(e, request(max_tokens=1, adapter="sql")))
    args = e._llm.args
    assert args.enable_lora is True and args.max_lora_rank == 64
    assert (args.max_loras, args.max_cpu_loras) == (8, 16)
    assert e._llm.calls[-1]["lora_request"].lora_name == "sql"


def test_gather_generation_logits_is_passed_only_where_llm_args_have_it(standin: Any, tmp_path: Path) -> None:
    e = make_engine(standin, tmp_path, "v0", build={"gather_generation_logits": True})
    asyncio.run(e.start())
    assert not hasattr(e._llm.args, "gather_generation_logits")
    v1 = make_engine(standin, tmp_path / "v1", "v1", build={"gather_generation_logits": True})
    asyncio.run(v1.start())
    assert v1._llm.kwargs.get("gather_generation_logits") is True


def test_lora_on_a_1x_tensorrt_engine_keeps_the_engines_target_modules(standin: Any, tmp_path: Path) -> None:
    e = make_engine(standin, tmp_path, "v1", adapters_dir=str(adapters(tmp_path)), build=LORA_ENGINE)
    deltas = asyncio.run(collect(e, request(max_tokens=1, adapter="sql")))
    assert e._llm.lora_module_layers == 2 * 3
    assert deltas and e._llm.calls[-1]["lora_request"].lora_name == "sql"


@pytest.mark.parametrize("generation", ["v1", "v0", "jetson"])
def test_a_stop_token_stays_in_the_output_as_on_the_torch_engine(
    standin: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, generation: str
) -> None:
    """TensorRT-LLM trims a matched stop token from token_ids unless include_stop_str_in_output; the
    torch engine keeps it (and counts it). 0.12 has no stop_reason: the kept token is how we know."""
    e = make_engine(standin, tmp_path, generation, jetson=generation == "jetson", monkeypatch=monkeypatch)
    deltas = asyncio.run(collect(e, request(max_tokens=8, stop_token_ids=(12,))))
    assert tokens(deltas) == [10, 11, 12]
    assert (finish(deltas).finish_reason, finish(deltas).stop_token_id) == ("stop", 12)


def test_ignore_eos_keeps_the_stop_token_ids_on_main(standin: Any, tmp_path: Path) -> None:
    """Main's worker sends stop_words=[] when ignore_eos is set: our own check must stop on them."""
    e = make_engine(standin, tmp_path, "v1")
    set_version("1.4.0")
    e = make_engine_here(e)
    deltas = asyncio.run(collect(e, request(max_tokens=8, stop_token_ids=(12,), ignore_eos=True)))
    assert tokens(deltas) == [10, 11, 12]
    assert (finish(deltas).finish_reason, finish(deltas).stop_token_id) == ("stop", 12)
    assert e._llm.aborted, "the request runs on in TensorRT-LLM after our stop"


def make_engine_here(e: Any) -> Any:
    """The same engine directory, probed again (after the stand-in's version was changed)."""
    from trtserver.engine.trtllm import TrtllmEngine

    return TrtllmEngine(e.config)


@pytest.mark.parametrize(("generation", "engine", "vocab"), [("v1", False, 80), ("v1", True, 60), ("jetson", True, 80)])
def test_embedding_bias_has_the_models_vocab_size(
    standin: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, generation: str, engine: bool, vocab: int
) -> None:
    """config.json's vocab_size is often padded past the tokenizer's 64 (Qwen2.5: 151936 vs 151665)."""
    e = make_engine(standin, tmp_path, generation, engine=engine, jetson=generation == "jetson",
                    monkeypatch=monkeypatch, build={"vocab_size": vocab})
    asyncio.run(collect(e, request(max_tokens=2, logit_bias=((5, 2.0),))))
    bias = e._llm.calls[-1]["sampling_params"].embedding_bias
    assert bias.shape == (vocab,) and float(bias[5]) == 2.0


def test_request_error_at_enqueue_is_a_400_or_a_503(standin: Any, tmp_path: Path) -> None:
    from trtserver.errors import InvalidRequest, Overloaded

    e = make_engine(standin, tmp_path, "v1", build={"max_input_len": 4})

    async def run(req: Any, queue: int | None = None) -> None:
        await e.start()
        e._llm.max_queue_size = queue
        [d async for d in e.generate(req)]

    with pytest.raises(InvalidRequest) as bad:
        asyncio.run(run(request(prompt=[2, 3, 4, 5, 6], max_tokens=1)))
    assert bad.value.status == 400 and "Prompt length" in bad.value.message
    with pytest.raises(Overloaded) as busy:
        asyncio.run(run(request(max_tokens=1), queue=0))
    assert busy.value.status == 503 and "try again later" in busy.value.message


def test_pytorch_10_logprobs_above_0_are_refused(standin: Any, tmp_path: Path) -> None:
    """1.0's PyTorch backend returns the sampled token's logprob as a float: no top alternatives."""
    standin("v1")
    set_version("1.0.0")
    e = make_engine_here(make_engine_keep(standin, tmp_path))
    assert e.check(request(logprobs=1))[0][0] == "logprobs"
    assert e.info.capabilities.max_logprobs == 0
    deltas = asyncio.run(collect(e, request(max_tokens=2, logprobs=0)))
    assert [lp for d in deltas for lp in d.logprobs or []] == [-0.25, -0.25]


def make_engine_keep(standin: Any, tmp_path: Path) -> Any:
    """A PyTorch-backend engine on the already imported stand-in (its version as the test set it)."""
    from trtserver.engine.trtllm import TrtllmEngine

    root = harness.make_engine_dir(tmp_path / "e", trtllm_version=None)
    return TrtllmEngine(ServerConfig(engine_dir=str(root)))


@pytest.mark.parametrize("backend", ["outlines", "llguidance"])
def test_pytorch_guided_backend_is_passed_only_when_it_can_be(
    standin: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """TorchLlmArgs.guided_decoding_backend is Literal["xgrammar", "llguidance"]; anything else fails at
    LLM(); llguidance must be importable."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llguidance" else real(name, *a))
    e = make_engine(standin, tmp_path, "v1", engine=False, trtllm_guided_decoding_backend=backend)
    asyncio.run(e.start())
    assert "guided_decoding_backend" not in e._llm.kwargs


# --- what TensorRT-LLM can do that was refused -------------------------------------------------------


def test_ignore_eos_on_012_sends_end_id_minus_1(standin: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    e = make_engine(standin, tmp_path, "jetson", jetson=True, monkeypatch=monkeypatch)

    async def run() -> Any:
        await e.start()
        e._llm.script = [5, 1, 6, 7]
        return [d async for d in e.generate(request(max_tokens=4, ignore_eos=True))]

    deltas = asyncio.run(run())
    assert tokens(deltas) == [5, 1, 6, 7] and finish(deltas).finish_reason == "length"
    assert e._llm.calls[-1]["sampling_params"].end_id == -1


@pytest.mark.parametrize("generation", ["v0", "jetson"])
def test_top_logprobs_before_020_from_generation_logits(
    standin: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, generation: str
) -> None:
    """0.12-0.19 have no logprobs:int, but return_generation_logits on an engine built to gather them."""
    import torch

    e = make_engine(standin, tmp_path, generation, jetson=generation == "jetson", monkeypatch=monkeypatch,
                    build={"gather_generation_logits": True})
    import standin_core
    assert e.info.capabilities.max_logprobs > 0
    deltas = asyncio.run(collect(e, request(max_tokens=3, logprobs=2)))
    assert tokens(deltas) == [10, 11, 12]
    values = [v for d in deltas for v in d.logprobs or []]
    tops = [t for d in deltas for t in d.top_logprobs or []]
    for tok, value, top in zip([10, 11, 12], values, tops, strict=True):
        row = torch.log_softmax(standin_core.generation_logits_row(tok, len(harness.VOCAB)), dim=-1)
        assert value == pytest.approx(float(row[tok]))
        assert [t for t, _ in top] == [tok, tok + 1]
        assert [v for _, v in top] == pytest.approx([float(row[tok]), float(row[tok + 1])])
    plain = make_engine(standin, tmp_path / "plain", generation, jetson=generation == "jetson",
                        monkeypatch=monkeypatch)
    assert plain.check(request(logprobs=2))[0][0] == "logprobs"


class BeamConfig(ServerConfig, kw_only=True):
    """The server option a PyTorch-backend beam search needs (the LLM's max_beam_width)."""

    trtllm_max_beam_width: int = 1


@pytest.mark.parametrize("version", ["1.0.0", "1.2.0"])
def test_beam_search_on_the_pytorch_backend_when_started_for_it(standin: Any, tmp_path: Path, version: str) -> None:
    from trtserver.engine.trtllm import TrtllmEngine

    standin("v1")
    set_version(version)
    root = harness.make_engine_dir(tmp_path / "e", trtllm_version=None)
    plain = TrtllmEngine(ServerConfig(engine_dir=str(root)))
    assert plain.check(request(n=2, use_beam_search=True))[0][0] == "use_beam_search"
    e = TrtllmEngine(BeamConfig(engine_dir=str(root), trtllm_max_beam_width=4))
    assert e.info.capabilities.beam_search
    assert e.check(request(n=8, use_beam_search=True))[0][0] == "use_beam_search"
    deltas = asyncio.run(collect(e, request(n=2, use_beam_search=True, max_tokens=3)))
    assert sorted({d.index for d in deltas}) == [0, 1] and tokens(deltas, 0) == [10, 11, 12]
    assert e._llm.kwargs["max_beam_width"] == 4
    assert e._llm.kwargs.get("enable_trtllm_sampler", False) is (version == "1.0.0")
