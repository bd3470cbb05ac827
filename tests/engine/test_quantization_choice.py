"""Which weights the CPU engine decodes with: ``--quantization`` auto and by hand, and the dtype that goes with it."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from tests.engine.test_torch_engine import PROMPTS, greedy
from trtserver.engine.torch import loader
from trtserver.engine.torch.cpu import kernels
from trtserver.engine.torch.engine import TorchEngine
from trtserver.engine.torch.loader import pick_cpu_dtype


@pytest.mark.parametrize("kind", ["int4", "int8"])
async def test_quantized_weights_still_know_paris(smol_dir, kind: str) -> None:  # type: ignore[no-untyped-def]
    eng = TorchEngine.from_dir(smol_dir, quantization=kind, device="cpu", max_batch_size=2, max_model_len=128,
                               threads=1)  # the ServerConfig field
    await eng.start()
    try:
        # int8 runs in bfloat16; int4 in float32 with the engine's own kernel, else in the dtype the CPU decodes
        # fastest
        own_kernel = loader.int4_kernel_wins() and kernels.load()
        assert eng.dtype == (torch.bfloat16 if kind == "int8" else torch.float32 if own_kernel else pick_cpu_dtype())
        assert eng.quantize == kind and eng.core.model_runner.accelerated is not None
        assert "Paris" in eng.tokenizer.decode(await greedy(eng, "The capital of France is", max_tokens=4))
        # two rows at once still take the quantized kernel; the answer stays sensible
        both = await asyncio.gather(*(greedy(eng, p, max_tokens=4) for p in PROMPTS[:2]))
        assert "Paris" in eng.tokenizer.decode(both[0])
    finally:
        await eng.shutdown()


def test_quantization_auto_is_int4_for_a_q4_gguf_on_the_cpu(smol_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    assert json.loads((smol_dir / "trtserver.json").read_text())["source"]["quantization"] == "Q4_1"
    # the quantization choice, on a CPU whose bfloat16 GEMMs are row-invariant (the next test: one whose are not)
    monkeypatch.setattr("trtserver.engine.torch.cpu.weights.bf16_rows_invariant", lambda: True)
    def quantize(**options: object) -> str | None:
        return TorchEngine.from_dir(smol_dir, device="cpu", **options).quantize  # type: ignore[arg-type]

    assert quantize(dtype="bfloat16") == "int4"
    assert quantize(dtype="bfloat16", batch_invariant=True) is None
    assert quantize() == "int4"  # in the dtype the CPU decodes fastest, float32 included
    assert quantize(dtype="float32") is None  # float32 asked for is full precision ...
    assert quantize(dtype="float32", quantization="int4") == "int4"  # ... unless int4 is asked for too
    with pytest.raises(ValueError, match="int8"):
        quantize(dtype="float32", quantization="int8")
    assert quantize(dtype="bfloat16", quantization="none") is None
    with pytest.raises(ValueError, match="batch_invariant"):
        quantize(dtype="bfloat16", quantization="int4", batch_invariant=True)
    # what changes the tokens changes the system fingerprint's inputs
    def inputs(**options: object) -> dict:  # type: ignore[type-arg]
        return TorchEngine.from_dir(smol_dir, device="cpu", dtype="bfloat16", **options).info.fingerprint_inputs

    fast, strict = inputs(), inputs(batch_invariant=True)
    assert (fast["quantization"], fast["batch_invariant"]) == ("int4", False)
    assert (strict["quantization"], strict["batch_invariant"]) == ("none", True)


def test_quantization_auto_is_none_without_a_4bit_source(smol_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    for f in smol_dir.iterdir():
        (tmp_path / f.name).symlink_to(f)
    manifest = json.loads((smol_dir / "trtserver.json").read_text())
    manifest["source"].pop("quantization")
    (tmp_path / "trtserver.json").unlink()
    (tmp_path / "trtserver.json").write_text(json.dumps(manifest))
    assert TorchEngine.from_dir(tmp_path, device="cpu", dtype="bfloat16").quantize is None


def test_int4_takes_the_fused_kernels_layout_where_it_wins(smol_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    for flags, wins in (({"avx2", "fma"}, True), ({"avx2", "fma", "avx512f", "avx512bw"}, True), ({"avx2"}, False),
                        (set(), False)):
        monkeypatch.setattr(loader, "_cpu_flags", lambda flags=flags: flags)
        assert loader.int4_kernel_wins() is wins
    monkeypatch.undo()
    eng = TorchEngine.from_dir(smol_dir, quantization="int4", device="cpu", max_batch_size=32, max_model_len=64,
                               threads=1)
    eng.load()
    assert eng.core is not None
    projection, head = eng.core.model.layers[0].attention.wqkv, eng.core.model.output
    assert projection.kernel_layout is head.kernel_layout is (loader.int4_kernel_wins() and kernels.load())
    # the engine's own int4 kernel beats the float32 weights at every decode batch size, ATen's up to 4 rows
    assert eng.core.model_runner.small_batch == (32 if projection.kernel_layout else 4)


def test_a_batch_invariant_cpu_server_takes_bfloat16_only_where_its_gemms_are_row_invariant(
        smol_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from trtserver.config import ServerConfig
    from trtserver.manifest import load_manifest

    manifest = load_manifest(smol_dir)

    def dtype(invariant: bool, **options: object) -> torch.dtype | None:
        monkeypatch.setattr("trtserver.engine.torch.cpu.weights.bf16_rows_invariant", lambda: invariant)
        config = ServerConfig(engine_dir=str(smol_dir), device="cpu", **options)  # type: ignore[arg-type]
        return loader.place(config, manifest, "auto").dtype

    assert dtype(False, batch_invariant=True) == torch.float32  # auto
    assert dtype(False, batch_invariant=True, dtype="float32") == torch.float32
    with pytest.raises(ValueError, match="batch_invariant and dtype='bfloat16'"):
        dtype(False, batch_invariant=True, dtype="bfloat16")
    assert dtype(True, batch_invariant=True) is None  # auto: the dtype the CPU decodes fastest, at load
    assert dtype(True, batch_invariant=True, dtype="bfloat16") == torch.bfloat16
    assert dtype(False, dtype="bfloat16") == torch.bfloat16  # without batch_invariant, no matter
    assert dtype(False) is None

