"""GGUF -> HF conversion on tiny synthetic GGUF files (no download, no torch needed except RoPE check)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from build_engines.gguf_convert import (
    GgufConvertError,
    hf_config,
    hf_name,
    iter_hf_tensors,
    open_gguf,
    permute,
    served_name_for,
    unpermute,
)
from build_engines.gguf_tokenizer import build_tokenizer, generation_config, tokenizer_config
from build_engines.synthetic import SPECIAL_TOKENS, TinyLlama, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.Q8_0.gguf"
    weights = write_tiny_gguf(path, quantize_embeddings=True)
    return path, weights


def test_permute_round_trip() -> None:
    rng = np.random.default_rng(1)
    for n_head, rows, cols in ((9, 576, 8), (3, 192, 8), (4, 64, 1)):
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        assert not np.array_equal(permute(w, n_head), w)
        np.testing.assert_array_equal(unpermute(permute(w, n_head), n_head), w)
        np.testing.assert_array_equal(permute(unpermute(w, n_head), n_head), w)
    bias = np.arange(64, dtype=np.float32)
    np.testing.assert_array_equal(unpermute(permute(bias, 4), 4), bias)


def _rope_hf(x: np.ndarray, pos: int, base: float) -> np.ndarray:
    """HF rotate_half RoPE on one head: pairs (i, i + d/2)."""
    d = x.shape[-1]
    freqs = base ** (-np.arange(0, d, 2) / d) * pos
    cos, sin = np.cos(np.concatenate([freqs, freqs])), np.sin(np.concatenate([freqs, freqs]))
    rotated = np.concatenate([-x[d // 2 :], x[: d // 2]])
    return np.asarray(x * cos + rotated * sin)


def _rope_ggml(x: np.ndarray, pos: int, base: float) -> np.ndarray:
    """GGML's "normal" RoPE used for llama: adjacent pairs (2i, 2i + 1)."""
    d = x.shape[-1]
    theta = base ** (-np.arange(0, d, 2) / d) * pos
    out = x.copy()
    out[0::2] = x[0::2] * np.cos(theta) - x[1::2] * np.sin(theta)
    out[1::2] = x[0::2] * np.sin(theta) + x[1::2] * np.cos(theta)
    return out


def test_permute_maps_hf_rope_layout_to_ggml_rope_layout() -> None:
    """Attention scores agree: HF weights + rotate_half RoPE == permuted weights + GGML RoPE.

    This pins the direction of the permutation, not just that unpermute inverts it.
    """
    rng = np.random.default_rng(2)
    n_head, d, hidden = 2, 16, 12
    wq, wk = rng.standard_normal((2, n_head * d, hidden))
    xq, xk = rng.standard_normal((2, hidden))
    gq, gk = permute(wq, n_head), permute(wk, n_head)
    for head in range(n_head):
        rows = slice(head * d, (head + 1) * d)
        hf = _rope_hf(wq[rows] @ xq, 7, 10000.0) @ _rope_hf(wk[rows] @ xk, 3, 10000.0)
        ggml = _rope_ggml(gq[rows] @ xq, 7, 10000.0) @ _rope_ggml(gk[rows] @ xk, 3, 10000.0)
        assert hf == pytest.approx(ggml, rel=1e-9)
        wrong = _rope_ggml(wq[rows] @ xq, 7, 10000.0) @ _rope_ggml(wk[rows] @ xk, 3, 10000.0)
        assert hf != pytest.approx(wrong, rel=1e-3)  # without the permutation it would be wrong


def test_tensors_round_trip(tiny_gguf: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, weights = tiny_gguf
    reader = open_gguf(path)
    config = hf_config(reader, "float32")
    got = dict(iter_hf_tensors(reader, config))
    assert set(got) == set(weights)
    for name, expected in weights.items():
        assert got[name].dtype == np.float32 and got[name].shape == expected.shape, name
        if name == "model.embed_tokens.weight":  # stored as Q8_0
            np.testing.assert_allclose(got[name], expected, atol=2e-3)
        else:
            np.testing.assert_array_equal(got[name], expected, err_msg=name)


def test_config(tiny_gguf: tuple[Path, dict[str, np.ndarray]]) -> None:
    spec = TinyLlama()
    config = hf_config(open_gguf(tiny_gguf[0]), "bfloat16")
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["hidden_size"] == spec.hidden_size
    assert config["num_attention_heads"] == spec.num_attention_heads
    assert config["num_key_value_heads"] == spec.num_key_value_heads
    assert config["head_dim"] == spec.head_dim
    assert config["max_position_embeddings"] == spec.context_length
    assert config["rms_norm_eps"] == 1e-5  # not 9.999999747378752e-06
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == "bfloat16"
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["vocab_size"] == 3 + 256 + 6


def test_tokenizer(tiny_gguf: tuple[Path, dict[str, np.ndarray]]) -> None:
    reader = open_gguf(tiny_gguf[0])
    tok = build_tokenizer(reader)
    for text in ["the cat", "12345", "héllo wörld", "emoji 🎉🙂", "tabs\tand\nnewlines  "]:
        ids = tok.encode(text).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("12345").tokens == ["1", "2", "3", "4", "5"]
    assert tok.encode(" the").tokens == ["Ġthe"]
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tok.encode(f"a{token}b").ids[1] == token_id
    assert tok.decode(tok.encode("<|im_start|>hi").ids, skip_special_tokens=True) == "hi"

    config = tokenizer_config(reader, 256)
    assert config["bos_token"] == "<|im_start|>" and config["eos_token"] == "<|im_end|>"
    assert config["add_bos_token"] is False and config["model_max_length"] == 256
    assert "<|im_start|>" in config["chat_template"]
    assert generation_config(reader) == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_names() -> None:
    assert hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(GgufConvertError, match="rope_freqs"):
        hf_name("rope_freqs.weight")
    assert served_name_for("SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert served_name_for("Llama-3.2-1B-Instruct-Q4_K_M.gguf") == "Llama-3.2-1B-Instruct"
