"""Tiny random Llama models, as a GGUF file or an HF checkpoint directory, for fast tests.

The weights are random (the output is noise) but every shape, name and file is real: the GGUF
file has llama.cpp's Q/K row order and byte-level BPE tokenizer metadata, the HF directory loads
with ``transformers``. Importing this module needs numpy, gguf and tokenizers; writing an HF
checkpoint needs torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = (("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"))


@dataclass(frozen=True)
class TinyLlama:
    hidden_size: int = 64
    intermediate_size: int = 96
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    context_length: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 3 control tokens, the 256 byte-level symbols, a few merges."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = [*SPECIAL_TOKENS, *alphabet, *("".join(m) for m in MERGES)]
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    return tokens, types, [" ".join(m) for m in MERGES]


def random_hf_weights(spec: TinyLlama, vocab_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights in HF layout and names."""
    rng = np.random.default_rng(seed)
    h, i, d = spec.hidden_size, spec.intermediate_size, spec.head_dim

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    out = {"model.embed_tokens.weight": w(vocab_size, h), "model.norm.weight": 1 + w(h)}
    for n in range(spec.num_hidden_layers):
        p = f"model.layers.{n}."
        out |= {
            p + "self_attn.q_proj.weight": w(spec.num_attention_heads * d, h),
            p + "self_attn.k_proj.weight": w(spec.num_key_value_heads * d, h),
            p + "self_attn.v_proj.weight": w(spec.num_key_value_heads * d, h),
            p + "self_attn.o_proj.weight": w(h, spec.num_attention_heads * d),
            p + "mlp.gate_proj.weight": w(i, h),
            p + "mlp.up_proj.weight": w(i, h),
            p + "mlp.down_proj.weight": w(h, i),
            p + "input_layernorm.weight": 1 + w(h),
            p + "post_attention_layernorm.weight": 1 + w(h),
        }
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = w(vocab_size, h)
    return out


_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf: str) -> str:
    base, _, kind = hf.rpartition(".")
    if base.startswith("model.layers."):
        layer, _, part = base.removeprefix("model.layers.").partition(".")
        return f"blk.{layer}.{_TO_GGUF[part]}.{kind}"
    return f"{_TO_GGUF[base]}.{kind}"


def write_tiny_gguf(
    path: Path, spec: TinyLlama = TinyLlama(), *, seed: int = 0, quantize_embeddings: bool = False
) -> dict[str, np.ndarray]:
    """Write a llama GGUF the way llama.cpp's converter would; return the HF weights it encodes."""
    import gguf

    from build_engines.gguf_convert import permute

    tokens, types, merges = tiny_vocab()
    weights = random_hf_weights(spec, len(tokens), seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(spec.num_hidden_layers)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.hidden_size)
    w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_attention_heads)
    w.add_head_count_kv(spec.num_key_value_heads)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    for name, array in weights.items():
        if name.endswith("q_proj.weight"):
            array = permute(array, spec.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            array = permute(array, spec.num_key_value_heads)
        if quantize_embeddings and name == "model.embed_tokens.weight":
            q = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gguf_name(name), q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def tiny_tokenizer_json(path: Path) -> None:
    """A byte-level BPE ``tokenizer.json`` matching :func:`tiny_vocab`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, _, _ = tiny_vocab()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=list(MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.save(str(path))


def write_tiny_hf_checkpoint(
    path: Path,
    spec: TinyLlama = TinyLlama(),
    *,
    seed: int = 0,
    torch_dtype: str = "bfloat16",
    shards: int = 1,
    pytorch_bin: bool = False,
) -> dict[str, np.ndarray]:
    """Write config.json, weights (safetensors, sharded or .bin) and tokenizer files; return the weights."""
    import json

    import torch
    from safetensors.torch import save_file

    tokens, _, _ = tiny_vocab()
    weights = random_hf_weights(spec, len(tokens), seed)
    path.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "vocab_size": len(tokens),
        "max_position_embeddings": spec.context_length,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": torch_dtype,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False})
    )
    tiny_tokenizer_json(path / "tokenizer.json")
    dtype = getattr(torch, torch_dtype)
    tensors = {k: torch.from_numpy(v).to(dtype) for k, v in weights.items()}
    if spec.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # as save_pretrained(.bin) would
    names = sorted(tensors)
    groups = [names[n::shards] for n in range(shards)]
    ext = "bin" if pytorch_bin else "safetensors"
    stem = "pytorch_model" if pytorch_bin else "model"
    weight_map: dict[str, str] = {}
    for n, group in enumerate(groups):
        file = f"{stem}.{ext}" if shards == 1 else f"{stem}-{n + 1:05d}-of-{shards:05d}.{ext}"
        part = {k: tensors[k] for k in group}
        if pytorch_bin:
            torch.save(part, path / file)
        else:
            save_file(
                {k: v.contiguous().clone() for k, v in part.items()},
                str(path / file),
                metadata={"format": "pt"},
            )
        weight_map |= dict.fromkeys(group, file)
    if shards > 1:
        (path / f"{stem}.{ext}.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weights
