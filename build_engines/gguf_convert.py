"""GGUF (llama.cpp) Llama model -> Hugging Face Llama checkpoint tensors and ``config.json``.

llama.cpp's converter (``LlamaModel.permute`` in ``convert_hf_to_gguf.py``) reorders the rows of
``q_proj`` / ``k_proj`` inside each head from HF's "rotate_half" layout (first half of the head,
then second half) to GGML's interleaved-pairs layout. :func:`unpermute` undoes it, so the weights
work with standard HF RoPE.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from tqdm import tqdm

SUPPORTED_ARCHITECTURES = ("llama",)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GgufConvertError(ValueError):
    pass


def open_gguf(path: str | Path) -> GGUFReader:
    return GGUFReader(path)


def field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF -> GGUF row order of q/k (what llama.cpp's converter does); ``n_head`` of that projection."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF -> HF row order of q/k: the inverse of :func:`permute`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str:
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in _GLOBAL_NAMES and kind in ("weight", "bias"):
            return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise GgufConvertError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama equivalent")


def _round(x: float) -> float:
    # GGUF stores float32: 1e-05 comes back as 9.999999747378752e-06
    return float(f"{x:.7g}")


def hf_config(reader: GGUFReader, dtype: str) -> dict[str, Any]:
    """``config.json`` (HF LlamaConfig) from the GGUF metadata."""
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GgufConvertError(
            f"GGUF architecture {arch!r} is not supported (only {SUPPORTED_ARCHITECTURES})"
        )

    def meta(key: str, default: Any = None) -> Any:
        value = field(reader, f"{arch}.{key}", default)
        if value is None:
            raise GgufConvertError(f"GGUF metadata {arch}.{key} is missing")
        return value

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    tokens = field(reader, "tokenizer.ggml.tokens", [])
    names = {t.name for t in reader.tensors}
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(meta("attention.key_length", hidden // heads)),
        "rms_norm_eps": _round(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _round(meta("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "vocab_size": int(meta("vocab_size", len(tokens))),
        "max_position_embeddings": int(meta("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        value = field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            config[key.replace("padding", "pad")] = int(value)
    return config


def iter_hf_tensors(reader: GGUFReader, config: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """Dequantize every tensor to float32 in HF layout (out_features, in_features), with HF names."""
    heads = config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    for t in tqdm(reader.tensors, desc="dequantize", unit="tensor"):
        name = hf_name(t.name)
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims fastest-first
        array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if t.name.endswith((".attn_q.weight", ".attn_q.bias")):
            array = unpermute(array, heads)
        elif t.name.endswith((".attn_k.weight", ".attn_k.bias")):
            array = unpermute(array, kv_heads)
        if not array.flags.writeable:  # F32/F16 tensors are read-only views of the memory-mapped file
            array = array.copy()
        yield name, np.ascontiguousarray(array)


def weight_quantization(reader: GGUFReader) -> str | None:
    """The type most of the GGUF's matrices are stored in (``Q4_1``), or None when that is a float type."""
    kinds = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) == 2)
    if not kinds:
        return None
    kind = kinds.most_common(1)[0][0]
    return None if kind in ("F32", "F16", "BF16") else kind


def served_name_for(gguf_file: str) -> str:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct`` (drops the quantisation suffix)."""
    stem = Path(gguf_file).name.removesuffix(".gguf")
    return re.sub(r"[.-](?:I?Q\d\w*|[BF]F?16|F32)$", "", stem, flags=re.IGNORECASE)
