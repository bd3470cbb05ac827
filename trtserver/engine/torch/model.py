"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) in gpt-fast's idiom.

Built on the meta device and loaded from Hugging Face safetensors with ``assign=True``, so no
weight is allocated twice. q/k/v and gate/up are fused into one matmul each at load time.
Attention reads K/V from the static cache (``cache.py``) over the live length only (in decode,
rounded up to a few fixed lengths and masked: ``model_runner.attention_length``) with the attention its
``ForwardContext`` names. The model knows nothing of how it is run faster: the loader swaps in CPU weight
formats (``cpu/weights.py``), and the model runner (``model_runner.py``) picks each step's attention and
whether a CPU decode function (``cpu/``) or a CUDA graph (``graphs.py``) runs in its place.

The layers call their submodules' ``forward`` directly: ``nn.Module.__call__`` checks for hooks on
every call, and none are used here (LoRA swaps modules instead).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trtserver.engine.torch.cache import KVCache


@dataclass(frozen=True, slots=True)
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # type: ignore[type-arg]
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias
    o_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_dir(cls, engine_dir: str | Path) -> ModelArgs:
        """The args of an engine directory's model, from its ``config.json``."""
        return cls.from_hf_config(json.loads((Path(engine_dir) / "config.json").read_text()))

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArgs:  # type: ignore[type-arg]
        model_type = cfg.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"model_type {model_type!r} is not a Llama-family model (llama, mistral, qwen2)")
        n_heads = cfg["num_attention_heads"]
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            intermediate_size=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta", 10000.0),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
        )


def sdpa_attention(q: Tensor, keys: Tensor, values: Tensor, ctx: ForwardContext) -> Tensor:
    """``q`` (B, T, nh, hs) against the live K/V (B, nkv, L, hs), masked as ``ctx`` says; (B, T, nh * hs)."""
    B, T, nh, hs = q.shape
    y = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values,  # (B, nh, T, hs) against (B, nkv, L, hs)
        attn_mask=ctx.mask, is_causal=ctx.causal, enable_gqa=nh != keys.shape[1],
    )  # (B, nh, T, hs)
    return y.transpose(1, 2).reshape(B, T, nh * hs)


Attend = Callable[[Tensor, Tensor, Tensor, "ForwardContext"], Tensor]


@dataclass(slots=True)
class ForwardContext:
    """Where a batch's tokens sit in the cache, and how they attend. ``B`` rows of ``T`` tokens."""

    pos: Tensor  # (B, T) position of each token; padding points at the cache's scratch position
    slots: Tensor  # (B,) KV slot of each row
    slot_start: int | None  # rows are slots slot_start.. in order: read the cache through a view
    length: int  # keys to attend over (the longest live length in the batch)
    mask: Tensor | None  # (B, 1, T, length) True = attend; None = every key visible, or causal
    causal: bool = False  # prefill of one prompt from position 0: T == length, no mask needed
    attend: Attend = sdpa_attention  # the model runner gives decode steps theirs (attention.py, cpu/attention.py)
    # the model runner's, not the model's: a decode batch on the small-batch kernels (model_runner.SMALL_BATCH)
    small: bool = False
    dense: tuple[Tensor, Tensor] | None = None  # the model runner's: flat K, V buffers (cpu/attention.py)
    _rows: Tensor | None = None
    _additive_mask: Tensor | None = None

    def cache_rows(self, cache: Tensor) -> Tensor:
        """Where each (row, token, kv head) goes in ``cache.view(-1, head_dim)``; the same for every
        layer, so computed once per forward."""
        if self._rows is None:
            _, nkv, positions, _ = cache.shape
            heads = torch.arange(nkv, device=cache.device)
            self._rows = ((self.slots.view(-1, 1, 1) * nkv + heads) * positions + self.pos.unsqueeze(-1)).view(-1)
        return self._rows

    def additive_mask(self) -> Tensor | None:
        """``mask`` as float32 0 / -inf, what SDPA turns a boolean mask into on every call (same
        bits); once per forward instead of once per layer."""
        if self._additive_mask is None and self.mask is not None:
            self._additive_mask = torch.zeros(self.mask.shape, device=self.mask.device).masked_fill_(
                ~self.mask, float("-inf"))
        return self._additive_mask


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Normalised in float32, then cast and scaled, as Hugging Face's (same bits)."""
    return F.rms_norm(x.float(), [x.shape[-1]], None, eps).to(x.dtype) * weight


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        qkv_dim = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        # nn.Module: swapped for packed or quantized linears after loading
        self.wqkv: nn.Module = nn.Linear(args.dim, qkv_dim, bias=args.qkv_bias)
        self.wo: nn.Module = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.o_bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                ctx: ForwardContext) -> Tensor:
        B, T, _ = x.shape
        nh, nkv, hs = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv.forward(x)  # (B, T, (nh + 2 nkv) * hs)
        qk, v = qkv.split([(nh + nkv) * hs, nkv * hs], dim=-1)
        qk = apply_rope(qk.view(B, T, nh + nkv, hs), cos, sin)  # rotate q and k in one go
        q, k = qk.split([nh, nkv], dim=2)  # (B, T, nh, hs), (B, T, nkv, hs)
        v = v.view(B, T, nkv, hs)
        rows = ctx.cache_rows(k_cache)  # (B * T * nkv,) rows of the cache seen as (-1, hs)
        k_cache.view(-1, hs).index_copy_(0, rows, k.reshape(-1, hs))
        v_cache.view(-1, hs).index_copy_(0, rows, v.reshape(-1, hs))
        if ctx.slot_start is not None:
            keys = k_cache[ctx.slot_start:ctx.slot_start + B, :, :ctx.length]  # (B, nkv, L, hs), a view
            values = v_cache[ctx.slot_start:ctx.slot_start + B, :, :ctx.length]
        else:
            keys = k_cache[ctx.slots, :, :ctx.length]  # (B, nkv, L, hs), gathered
            values = v_cache[ctx.slots, :, :ctx.length]
        return self.wo.forward(ctx.attend(q, keys, values, ctx))  # (B, T, nh * hs) in


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w13: nn.Module = nn.Linear(args.dim, 2 * args.intermediate_size, bias=args.mlp_bias)  # gate, up
        self.w2: nn.Module = nn.Linear(args.intermediate_size, args.dim, bias=args.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13.forward(x).chunk(2, dim=-1)
        return self.w2.forward(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                ctx: ForwardContext) -> Tensor:
        h = x + self.attention.forward(self.attention_norm.forward(x), cos, sin, k_cache, v_cache, ctx)
        return h + self.feed_forward.forward(self.ffn_norm.forward(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        # an explicit (meta) weight skips the random init, whose meta-device path imports torch._dynamo
        # and triton for a tensor the checkpoint replaces anyway
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, _weight=torch.empty(args.vocab_size, args.dim))
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.rope_cos: Tensor | None = None
        self.rope_sin: Tensor | None = None

    def setup_rope(self, max_len: int) -> None:
        """Precompute cos and signed sin (``apply_rope``) for positions 0..max_len (the last one is
        the cache's scratch)."""
        cos, sin = rope_tables(self.args, max_len + 1, self.tok_embeddings.weight.device)
        half = self.args.head_dim // 2
        sin[:, :half].neg_()
        dtype = self.tok_embeddings.weight.dtype
        self.rope_cos, self.rope_sin = cos.to(dtype), sin.to(dtype)

    def forward(self, tokens: Tensor, ctx: ForwardContext, cache: KVCache) -> Tensor:
        """Hidden states after the final norm, ``(B, T, dim)``; the caller picks rows for ``logits``."""
        x = self.tok_embeddings(tokens)  # (B, T, dim)
        cos, sin = self.rope(ctx.pos)
        for layer, k_cache, v_cache in zip(self.layers, cache.k, cache.v):
            x = layer.forward(x, cos, sin, k_cache, v_cache, ctx)
        return self.norm(x)

    def rope(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """cos and signed sin at ``pos`` (B, T), as (B, T, 1, head_dim): one row for every head."""
        assert self.rope_cos is not None and self.rope_sin is not None
        return self.rope_cos[pos].unsqueeze(2), self.rope_sin[pos].unsqueeze(2)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.output(hidden).float()  # (..., vocab)


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Hugging Face's rotate-half convention (the checkpoints' q/k rows are permuted for it):
    ``x * cos + cat(-x2, x1) * sin``, written as ``x * cos + cat(x2, x1) * cat(-sin, sin)`` with the
    sign in the table, which is the same bits in two fewer ops."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def rope_tables(args: ModelArgs, n_pos: int, device: torch.device) -> tuple[Tensor, Tensor]:
    hs = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, hs, 2, dtype=torch.float64) / hs))
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind not in (None, "default"):
        raise ValueError(f"rope_scaling type {kind!r} is not supported by the PyTorch engine")
    freqs = torch.outer(torch.arange(n_pos, dtype=torch.float64), inv_freq)  # (n_pos, hs / 2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (n_pos, hs)
    return emb.cos().float().to(device), emb.sin().float().to(device)


def _llama3_inv_freq(inv_freq: Tensor, s: dict) -> Tensor:  # type: ignore[type-arg]
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


# ---- loading ---------------------------------------------------------------------------------

_HF_NAMES = {
    "self_attn.o_proj": "attention.wo",
    "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}


def load_model(engine_dir: str | Path, dtype: torch.dtype, device: torch.device) -> Transformer:
    """Build on the meta device, then assign the checkpoint's tensors (fused, cast, moved)."""
    from safetensors import safe_open

    engine_dir = Path(engine_dir)
    args = ModelArgs.from_dir(engine_dir)
    files = sorted(engine_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{engine_dir}: no *.safetensors weights")
    raw: dict[str, Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                raw[name] = f.get_tensor(name)

    def take(name: str) -> Tensor:
        return raw.pop(name).to(device=device, dtype=dtype)

    state: dict[str, Tensor] = {"tok_embeddings.weight": take("model.embed_tokens.weight"),
                                "norm.weight": take("model.norm.weight")}
    for i in range(args.n_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for kind in ("weight", "bias") if args.qkv_bias else ("weight",):
            state[ours + f"attention.wqkv.{kind}"] = torch.cat(
                [take(hf + f"self_attn.{p}_proj.{kind}") for p in "qkv"])
        for kind in ("weight", "bias") if args.mlp_bias else ("weight",):
            state[ours + f"feed_forward.w13.{kind}"] = torch.cat(
                [take(hf + f"mlp.{p}_proj.{kind}") for p in ("gate", "up")])
        for src, dst in _HF_NAMES.items():
            state[ours + dst + ".weight"] = take(hf + src + ".weight")
            if hf + src + ".bias" in raw:
                state[ours + dst + ".bias"] = take(hf + src + ".bias")
    if "lm_head.weight" in raw and not args.tie_word_embeddings:
        state["output.weight"] = take("lm_head.weight")
    else:
        state["output.weight"] = state["tok_embeddings.weight"]
    with torch.device("meta"):
        model = Transformer(args)
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval().requires_grad_(False)
