"""Tiny random Llama (GQA) and Qwen2 (q/k/v biases) checkpoints: the engine's chunked, cached
forward against a naive full-sequence reference written from the Hugging Face definitions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from trtserver.engine.base import GenerationRequest, SamplingParams
from trtserver.engine.torch.core import EngineCore
from trtserver.engine.torch.model import load_model
from trtserver.engine.torch.model_runner import SMALL_BATCH, attention_length

V, D, LAYERS, H, KV, FF = 96, 64, 2, 4, 2, 80
HS = D // H


def make_checkpoint(path: Path, model_type: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.3

    t = {"model.embed_tokens.weight": r(V, D), "model.norm.weight": 1 + r(D)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name, rows in (("q", H * HS), ("k", KV * HS), ("v", KV * HS)):
            t[p + f"self_attn.{name}_proj.weight"] = r(rows, D)
            if model_type == "qwen2":
                t[p + f"self_attn.{name}_proj.bias"] = r(rows)
        t[p + "self_attn.o_proj.weight"] = r(D, H * HS)
        t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = r(FF, D), r(FF, D)
        t[p + "mlp.down_proj.weight"] = r(D, FF)
        t[p + "input_layernorm.weight"], t[p + "post_attention_layernorm.weight"] = 1 + r(D), 1 + r(D)
    t["lm_head.weight"] = r(V, D)
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(dict(
        model_type=model_type, vocab_size=V, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=H,
        num_key_value_heads=KV, intermediate_size=FF, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=128, tie_word_embeddings=False)))
    return t


def reference_logits(t: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def rope(x: torch.Tensor) -> torch.Tensor:  # (heads, T, hs), HF rotate_half
        inv = 1.0 / (10000.0 ** (torch.arange(0, HS, 2).float() / HS))
        f = torch.outer(torch.arange(x.shape[1]).float(), inv)
        cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
        x1, x2 = x[..., : HS // 2], x[..., HS // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    T = len(ids)
    x = t["model.embed_tokens.weight"][ids]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"])
        proj = {n: h @ t[p + f"self_attn.{n}_proj.weight"].T + t.get(p + f"self_attn.{n}_proj.bias", 0)
                for n in "qkv"}
        q = rope(proj["q"].view(T, H, HS).transpose(0, 1))
        k = rope(proj["k"].view(T, KV, HS).transpose(0, 1)).repeat_interleave(H // KV, 0)
        v = proj["v"].view(T, KV, HS).transpose(0, 1).repeat_interleave(H // KV, 0)
        att = (q @ k.transpose(-1, -2)) / HS ** 0.5 + torch.full((T, T), float("-inf")).triu(1)
        x = x + (att.softmax(-1) @ v).transpose(0, 1).reshape(T, D) @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        gate, up = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T
    return rms(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


@pytest.mark.parametrize("small_batch", [0, SMALL_BATCH], ids=["one-kernel-set", "small-batch-kernels"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_chunked_cached_forward_matches_reference(tmp_path: Path, model_type: str, small_batch: int) -> None:
    """With ``small_batch``, decode of up to 3 rows takes the float32 attention over a padded, masked
    key length (the bfloat16 CPU engine's small-batch path; float32 here, so exact)."""
    weights = make_checkpoint(tmp_path, model_type)
    model = load_model(tmp_path, torch.float32, torch.device("cpu"))
    core = EngineCore(model, num_slots=3, max_len=64, chunk_size=16, eos_token_ids=(), device=torch.device("cpu"),
                      small_batch=small_batch)
    prompts = [[(7 * i + 3) % V for i in range(40)], [5, 9, 11], [(3 * i) % V for i in range(20)]]
    for n, prompt in enumerate(prompts):  # three prompts: chunked, shared chunks, batched decode
        core.add(GenerationRequest(f"r{n}", prompt, SamplingParams(max_tokens=6, temperature=0.0,
                                                                     prompt_logprobs=0, logprobs=0)))
    outputs: dict[str, list] = {}
    while core.has_work:
        for delta in core.step():
            outputs.setdefault(delta.request_id, []).append(delta)
    for n, prompt in enumerate(prompts):
        deltas = outputs[f"r{n}"]
        generated = [t for d in deltas for t in d.token_ids]
        assert len(generated) == 6
        full = prompt + generated
        ref = torch.log_softmax(reference_logits(weights, full), dim=-1)
        # greedy tokens are the reference's argmax at every step
        assert generated == ref[len(prompt) - 1:-1].argmax(-1).tolist()
        # prompt logprobs (computed chunk by chunk) and generated logprobs match the reference
        plp = deltas[0].prompt_token_logprobs
        assert plp is not None and plp[0] is None
        expected = ref[:-1].gather(1, torch.tensor(full[1:]).unsqueeze(1)).squeeze(1)
        assert torch.allclose(torch.tensor(plp[1:]), expected[: len(prompt) - 1], atol=1e-4)
        got = torch.tensor([x for d in deltas for x in d.logprobs])
        assert torch.allclose(got, expected[len(prompt) - 1:], atol=1e-4)



@pytest.mark.parametrize(("n", "expected"), [(1, 16), (16, 16), (17, 32), (100, 112), (129, 144), (1000, 1024)])
def test_attention_length_rounds_up_a_little(n: int, expected: int) -> None:
    assert attention_length(n) == expected


def test_attention_length_takes_few_shapes_and_pads_little() -> None:
    lengths = [attention_length(n) for n in range(1, 8193)]
    assert all(length >= n for n, length in enumerate(lengths, 1))
    assert all(length - n < max(16, n / 8) for n, length in enumerate(lengths, 1))
    assert len(set(lengths)) <= 8 * 10  # about 8 per octave
