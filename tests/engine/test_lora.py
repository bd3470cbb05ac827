"""LoRA adapters on the PyTorch engine, checked against transformers + peft on SmolLM2-135M.

The adapters are made here, at test time, with the ``peft`` library on top of the engine directory's
own weights (B initialised non-zero, so they change the output), and saved into a temporary adapters
directory the way users ship them.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from trtserver.adapters import AdapterRegistry, check_name
from trtserver.engine.base import GenerationRequest, SamplingParams
from trtserver.engine.torch.engine import TorchEngine
from trtserver.errors import InvalidRequest, NotFound, Unsupported

pytest.importorskip("peft")
pytest.importorskip("transformers")

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# longer than the engine fixture's 16-token prefill chunk, so the prompt is prefilled in pieces
PROMPT = "Here is a short story about a lighthouse keeper who finds a message in a bottle one stormy night:"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot",
           "The three primary colours are"]
MAX_TOKENS = 8
_ids = iter(range(10**9))


def make_adapter(base: Any, out_dir: Path, *, target_modules: list[str], r: int = 8, alpha: int = 16,
                 use_rslora: bool = False, seed: int = 0, b_scale: float = 1.0) -> Any:
    """Wrap ``base`` (a transformers Llama) in a fresh LoRA with non-zero B, save it to ``out_dir``;
    return the PeftModel (call ``.unload()`` on it to get ``base`` back unchanged)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules, init_lora_weights=False,
                        use_rslora=use_rslora, lora_dropout=0.0)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    model.eval()
    model.save_pretrained(str(out_dir))
    return model


@pytest.fixture(scope="module")
def adapters(smol_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two adapters in one directory, with transformers+peft's log-probabilities (merged weights) for
    PROMPT + a greedy continuation under each (and under none): ``{"dir": Path, "ref": {name: (ids, logprobs)}}``."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.set_num_threads(1)  # as the engines do: two OpenMP threads stall when the cores are shared
    root = tmp_path_factory.mktemp("adapters")
    base = LlamaForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(smol_dir))
    ids = tok(PROMPT, return_tensors="pt").input_ids

    def reference(model: Any) -> tuple[list[int], torch.Tensor]:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=tok.eos_token_id or 0)
            logits = model(input_ids=out).logits[0, :-1].float()
        full = out[0].tolist()
        return full, torch.log_softmax(logits, -1).gather(1, out[0, 1:, None]).squeeze(1)

    refs = {"": reference(base)}
    specs = {"qv": dict(target_modules=["q_proj", "v_proj"], r=8, alpha=16, seed=1),
             "all": dict(target_modules=ALL_LINEAR, r=4, alpha=8, use_rslora=True, seed=2, b_scale=0.5)}
    for name, spec in specs.items():
        peft_model = make_adapter(base, root / name, **spec)  # type: ignore[arg-type]
        peft_model.merge_adapter()  # the reference is the merged model: W + scale * B @ A
        refs[name] = reference(peft_model)
        peft_model.unmerge_adapter()
        base = peft_model.unload()
    return {"dir": root, "ref": refs}


@pytest.fixture(scope="module")
def lora_engine(smol_dir: Path, adapters: dict[str, Any]) -> Iterator[TorchEngine]:
    # the same settings as the shared `engine` fixture (tests/engine/conftest.py), plus adapters
    eng = TorchEngine.from_dir(smol_dir, dtype="float32", device="cpu", max_batch_size=8, max_model_len=384,
                               prefill_chunk_size=16, seed=0, threads=1, adapters_dir=str(adapters["dir"]))
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.shutdown())


async def run(engine: TorchEngine, prompt: str | list[int], adapter: str | None, *, max_tokens: int = MAX_TOKENS,
              **params: Any) -> tuple[list[int], list[float], list[float | None] | None]:
    """Greedy tokens, their logprobs, and the prompt's token logprobs (when asked)."""
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0, **params)
    tokens: list[int] = []
    logprobs: list[float] = []
    prompt_lps = None
    async for delta in engine.generate(GenerationRequest(f"lora{next(_ids)}", ids, sampling, adapter=adapter)):
        tokens += delta.token_ids
        logprobs += delta.logprobs or []
        if delta.prompt_token_logprobs is not None:
            prompt_lps = delta.prompt_token_logprobs
    return tokens, logprobs, prompt_lps


# ---- the registry (no model) -----------------------------------------------------------------

@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "/etc", "/etc/passwd", "a\\b", "x\x00y", ".hidden",
                                  "a..b", "C:evil", "x" * 256])
def test_bad_names_are_400(name: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_name(name)
    assert info.value.status == 400 and info.value.param == "peft"


def test_registry_rules(adapters: dict[str, Any], tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "adapter_config.json").write_text("{}")
    for name in ("good", "rank", "bin", "dora"):
        (root / name).mkdir()
    good = adapters["dir"] / "qv"
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        (root / "good" / file).write_bytes((good / file).read_bytes())
    config = json.loads((good / "adapter_config.json").read_text())
    (root / "rank" / "adapter_config.json").write_text(json.dumps({**config, "r": 128}))
    (root / "bin" / "adapter_config.json").write_text(json.dumps(config))
    (root / "bin" / "adapter_model.bin").write_bytes(b"not really")
    (root / "dora" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    os.symlink(outside, root / "escape")
    os.symlink(root / "good", root / "alias")  # a link that stays inside is fine
    (root / "sneaky").mkdir()
    (root / "sneaky" / "adapter_config.json").symlink_to(outside / "adapter_config.json")

    registry = AdapterRegistry(root, max_rank=64)
    assert registry.names() == ["alias", "bin", "dora", "good", "rank", "sneaky"]
    assert registry.resolve("good") == (root / "good").resolve()
    loaded = registry.load_config("alias")
    assert (loaded.r, loaded.lora_alpha, loaded.scale) == (8, 16.0, 2.0)
    assert sorted(loaded.target_modules) == ["q_proj", "v_proj"]
    with pytest.raises(NotFound) as missing:
        registry.resolve("nope")
    assert missing.value.status == 404 and missing.value.code == "adapter_not_found"
    for name, words in [("escape", "outside"), ("sneaky", "outside"), ("rank", "max_lora_rank"),
                        ("bin", "adapter_model.bin"), ("dora", "DoRA")]:
        with pytest.raises(InvalidRequest) as bad:
            registry.load_config(name)
        assert bad.value.param == "peft" and words in bad.value.message, (name, bad.value.message)


# ---- the engine --------------------------------------------------------------------------------

def test_capability(lora_engine: TorchEngine, engine: TorchEngine) -> None:
    assert lora_engine.info.capabilities.adapters
    assert not engine.info.capabilities.adapters


@pytest.mark.parametrize("name", ["qv", "all"])
async def test_matches_peft(lora_engine: TorchEngine, adapters: dict[str, Any], name: str) -> None:
    ref_ids, ref_logprobs = adapters["ref"][name]
    prompt_len = len(lora_engine.tokenizer.encode(PROMPT))
    tokens, logprobs, prompt_lps = await run(lora_engine, ref_ids[:prompt_len], name, prompt_logprobs=0)
    assert tokens == ref_ids[prompt_len:]
    assert prompt_lps is not None and prompt_lps[0] is None
    ours = torch.tensor([*prompt_lps[1:], *logprobs])
    torch.testing.assert_close(ours, ref_logprobs, atol=2e-3, rtol=1e-3)
    # and the adapter matters: the base model continues differently
    assert adapters["ref"][""][0] != ref_ids


async def test_cached_prefixes_never_cross_adapters(lora_engine: TorchEngine, adapters: dict[str, Any]) -> None:
    """One prompt under each adapter in turn, twice over: the prefix cache serves a prompt only its own
    adapter's K/V, and a served prompt still continues exactly as transformers + peft's."""
    prompt_len = len(lora_engine.tokenizer.encode(PROMPT))
    for round_ in range(2):
        for name in ("qv", "", "all"):
            ref_ids, ref_logprobs = adapters["ref"][name]
            ids = ref_ids[:prompt_len]
            sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
            request = GenerationRequest(f"lora{next(_ids)}", ids, sampling, adapter=name or None)
            tokens: list[int] = []
            logprobs: list[float] = []
            async for delta in lora_engine.generate(request):
                tokens += delta.token_ids
                logprobs += delta.logprobs or []
                cached = delta.num_cached_tokens
            assert tokens == ref_ids[prompt_len:], (round_, name)
            torch.testing.assert_close(torch.tensor(logprobs), ref_logprobs[prompt_len - 1:], atol=2e-3, rtol=1e-3)
            if round_:  # every adapter's entry is there by now: each prompt is served from its own
                assert cached == prompt_len - 1, (name, cached)


async def test_base_unchanged_without_adapter(lora_engine: TorchEngine, engine: TorchEngine,
                                              adapters: dict[str, Any]) -> None:
    """No adapter: bit-identical to an engine without adapters support, and equal to transformers."""
    with_support = await run(lora_engine, PROMPT, None, prompt_logprobs=0)
    without = await run(engine, PROMPT, None, prompt_logprobs=0)
    assert with_support == without
    ref_ids, _ = adapters["ref"][""]
    prompt_len = len(engine.tokenizer.encode(PROMPT))
    assert with_support[0] == ref_ids[prompt_len:]


async def test_only_batches_without_adapters_take_the_scripted_decode(lora_engine: TorchEngine,
                                                                    monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """It runs the bare projections (and, on a LoRA server, never the fused kernels: the same bits as the
    eager layers, whatever else shares the batch); a batch with an adapter takes the wrapped layers."""
    decode = lora_engine.core.model_runner.accelerated
    assert decode is not None and not decode.fused_small and not decode.fused_batch
    calls: list[int] = []
    real = type(decode).__call__
    monkeypatch.setattr(type(decode), "__call__", lambda self, *args: (calls.append(1), real(self, *args))[1])
    await run(lora_engine, PROMPTS[0], None)
    base = len(calls)
    assert base >= MAX_TOKENS - 1  # every decode step of the base request
    await run(lora_engine, PROMPTS[0], "qv")
    assert len(calls) == base


async def test_adapter_changes_output(lora_engine: TorchEngine) -> None:
    base, _, _ = await run(lora_engine, PROMPTS[0], None)
    qv, _, _ = await run(lora_engine, PROMPTS[0], "qv")
    every, _, _ = await run(lora_engine, PROMPTS[0], "all")
    assert len({tuple(base), tuple(qv), tuple(every)}) == 3


async def test_mixed_batch_matches_alone(lora_engine: TorchEngine) -> None:
    """Two adapters and none in one batch (rows of one adapter not adjacent): each row gets the
    tokens it gets alone."""
    plan = [(PROMPTS[0], "qv"), (PROMPTS[1], None), (PROMPTS[2], "qv"), (PROMPTS[3], "all"), (PROMPT, None),
            (PROMPTS[0], "all")]
    # seeded: no row takes a cached prefix, whose shorter prefill may round a near tie apart
    alone = [(await run(lora_engine, p, a, seed=0))[0] for p, a in plan]
    core = lora_engine.core
    before = core.num_decode_forwards
    seen: list[int] = []  # adapters per forward that came as an index (rows not adjacent)
    bind = core.lora.bind

    def spy(row_adapters: list[Any]) -> bool:
        active = bind(row_adapters)
        seen.append(sum(isinstance(rows, torch.Tensor) for rows, _ in core.lora.batch.groups))
        return active

    core.lora.bind = spy
    try:
        together = await asyncio.gather(*(run(lora_engine, p, a, seed=0) for p, a in plan))
    finally:
        del core.lora.bind
    assert [t[0] for t in together] == alone
    assert max(seen) >= 1
    # they really shared steps: far fewer decode forwards than one per row per token
    assert core.num_decode_forwards - before < len(plan) * MAX_TOKENS // 2


async def test_n_and_beams_use_the_adapter(lora_engine: TorchEngine) -> None:
    # seeded: neither takes a cached prefix, whose shorter prefill may round a near tie apart
    alone, _, _ = await run(lora_engine, PROMPTS[2], "qv", max_tokens=4, seed=0)
    request = GenerationRequest(f"lora{next(_ids)}", lora_engine.tokenizer.encode(PROMPTS[2]),
                                SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, seed=0), n=2,
                                adapter="qv")
    tokens: dict[int, list[int]] = {}
    async for delta in lora_engine.generate(request):
        tokens.setdefault(delta.index, []).extend(delta.token_ids)
    assert tokens == {0: alone, 1: alone}


async def test_errors_before_queueing(lora_engine: TorchEngine, engine: TorchEngine) -> None:
    ids = lora_engine.tokenizer.encode(PROMPTS[0])
    sampling = SamplingParams(max_tokens=2)
    for name, kind, status in [("nope", NotFound, 404), ("../qv", InvalidRequest, 400), ("/etc", InvalidRequest, 400),
                               ("qv/../all", InvalidRequest, 400)]:
        with pytest.raises(kind) as info:
            lora_engine.generate(GenerationRequest(f"lora{next(_ids)}", ids, sampling, adapter=name))
        assert info.value.status == status and info.value.param == "peft"
    with pytest.raises(Unsupported):
        engine.generate(GenerationRequest(f"lora{next(_ids)}", ids, sampling, adapter="qv"))
    assert lora_engine.stats().waiting == 0


def test_lora_linear_rows() -> None:
    """The batched delta on a toy layer: adapter rows get x A^T B^T (index and slice paths), the
    other rows keep the base output bit for bit."""
    from trtserver.engine.torch.lora import LoraAdapter, LoraBatch, LoraLinear

    torch.manual_seed(0)
    base = torch.nn.Linear(6, 5, bias=False)
    batch = LoraBatch()
    layer = LoraLinear(base, batch, 0, "wo")
    a1 = LoraAdapter("a1", None, {(0, "wo"): (torch.randn(6, 2), torch.randn(2, 5))})  # type: ignore[arg-type]
    a2 = LoraAdapter("a2", None, {(0, "wo"): (torch.randn(6, 3), torch.randn(3, 5))})  # type: ignore[arg-type]
    x = torch.randn(4, 3, 6)
    plain = base(x)
    batch.groups[:] = [(torch.tensor([0, 2]), a1), (slice(3, 4), a2)]
    y = layer(x)
    assert torch.equal(y[1], plain[1])
    for row, adapter in ((0, a1), (2, a1), (3, a2)):
        at, bt = adapter.weights[(0, "wo")]
        torch.testing.assert_close(y[row], plain[row] + x[row] @ at @ bt)
    batch.groups.clear()
    assert torch.equal(layer(x), plain)
