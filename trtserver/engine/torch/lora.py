"""LoRA adapters for the PyTorch engine: load PEFT adapters, apply them per row of a batch.

Every projection of every block (``wqkv``, ``wo``, ``w13``, ``w2``) is wrapped once, at load, in a
``LoraLinear`` that first runs the base layer on the whole batch, then, for each adapter present in
the batch, adds ``(x[rows] @ A^T) @ B^T`` (the scale folded into ``B``) to that adapter's rows only.
Rows without an adapter are never written to, so their output is the base model's, bit for bit.
The engine fuses q/k/v and gate/up into one matmul each; their adapters are fused the same way: the
A matrices stacked (``R = r_q + r_k + r_v`` rows) and the B matrices placed block-diagonally, so one
adapter costs two small matmuls per fused projection whatever it targets.

``ModelRunner`` (``model_runner.py``) calls ``LoraManager.bind(groups)`` before each forward with the
request of every row; a batch without adapters costs one list scan and nothing in the model.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from trtserver.adapters import AdapterConfig, AdapterRegistry
from trtserver.errors import InvalidRequest

if TYPE_CHECKING:
    from trtserver.engine.torch.model import ModelArgs, Transformer

MAX_CACHED = 16  # adapters kept loaded (least recently used goes first; running requests keep theirs)

_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\."
                  r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])(?:\.[^.]+)?\.weight$")

# PEFT projection -> (engine module, which part of its output, in order)
_FUSED = {"wqkv": ("q_proj", "k_proj", "v_proj"), "wo": ("o_proj",), "w13": ("gate_proj", "up_proj"),
          "w2": ("down_proj",)}


@dataclass(eq=False, slots=True)
class LoraAdapter:
    """One loaded adapter: per (layer, engine module), ``At`` (in, R) and ``Bt`` (R, out), scale in Bt."""

    name: str
    config: AdapterConfig
    weights: dict[tuple[int, str], tuple[Tensor, Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


class LoraBatch:
    """Which rows of the running forward use which adapter: ``(rows, adapter)`` pairs, rows a slice
    when contiguous, else an index tensor. Empty when no row uses one. Shared by every LoraLinear."""

    __slots__ = ("groups",)

    def __init__(self) -> None:
        self.groups: list[tuple[slice | Tensor, LoraAdapter]] = []


class LoraLinear(nn.Module):
    """A projection (any module: nn.Linear, PackedLinear, Int4Linear) plus the batch's adapters."""

    def __init__(self, base: nn.Module, batch: LoraBatch, layer: int, key: str) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.key = (layer, key)

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.base(x)
        for rows, adapter in self.batch.groups:
            w = adapter.weights.get(self.key)
            if w is None:
                continue
            at, bt = w
            if isinstance(rows, slice):
                y[rows] += (x[rows] @ at) @ bt
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ at) @ bt)
        return y


class LoraManager:
    """Loads adapters by name (LRU cache), wraps the model's projections, binds batches to adapters."""

    def __init__(self, registry: AdapterRegistry, args: ModelArgs, dtype: torch.dtype, device: torch.device,
                 *, max_cached: int = MAX_CACHED) -> None:
        self.registry = registry
        self.args = args
        self.dtype = dtype
        self.device = device
        self.max_cached = max_cached
        self.batch = LoraBatch()
        self._cache: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._lock = threading.Lock()

    # ---- adapters ----------------------------------------------------------------------------
    def get(self, name: str) -> LoraAdapter:
        """The adapter named ``name``, loading it if needed; raises the client's 400/404.

        Called from the event loop (to refuse a request before it is queued) and from the engine
        thread; the lock makes the two agree on one copy."""
        with self._lock:
            adapter = self._cache.get(name)
            if adapter is not None:
                self._cache.move_to_end(name)
                return adapter
            config = self.registry.load_config(name)
            adapter = load_adapter(config, self.args, self.dtype, self.device)
            self._cache[name] = adapter
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return adapter

    def is_loaded(self, name: str) -> bool:
        return name in self._cache  # a dict lookup: safe without the lock

    def loaded(self) -> list[str]:
        with self._lock:
            return list(self._cache)

    # ---- model -------------------------------------------------------------------------------
    def install(self, model: Transformer) -> None:
        """Wrap every block's projections (after any packing or quantization of them)."""
        for i, layer in enumerate(model.layers):
            attn: Any = layer.attention
            ff: Any = layer.feed_forward
            attn.wqkv = LoraLinear(attn.wqkv, self.batch, i, "wqkv")
            attn.wo = LoraLinear(attn.wo, self.batch, i, "wo")
            ff.w13 = LoraLinear(ff.w13, self.batch, i, "w13")
            ff.w2 = LoraLinear(ff.w2, self.batch, i, "w2")

    def bind(self, adapters: list[Any]) -> bool:
        """Set the next forward's rows: ``adapters[b]`` is row b's LoraAdapter or None. True when any."""
        groups = self.batch.groups
        groups.clear()
        if not any(adapters):
            return False
        rows: dict[LoraAdapter, list[int]] = {}
        for b, adapter in enumerate(adapters):
            if adapter is not None:
                rows.setdefault(adapter, []).append(b)
        for adapter, idx in rows.items():
            if idx[-1] - idx[0] == len(idx) - 1:  # ascending by construction: contiguous
                groups.append((slice(idx[0], idx[-1] + 1), adapter))
            else:
                groups.append((torch.tensor(idx, device=self.device), adapter))
        return True

    def unbind(self) -> None:
        self.batch.groups.clear()


def load_adapter(config: AdapterConfig, args: ModelArgs, dtype: torch.dtype, device: torch.device) -> LoraAdapter:
    """Read ``adapter_model.safetensors`` and fuse its matrices the way the engine fuses its weights."""
    from safetensors import SafetensorError, safe_open

    def bad(reason: str) -> InvalidRequest:
        return InvalidRequest(f"adapter `{config.name}`: {reason}", param="peft")

    hs = args.head_dim
    dims = {  # PEFT projection -> (in_features, out_features)
        "q_proj": (args.dim, args.n_heads * hs), "k_proj": (args.dim, args.n_kv_heads * hs),
        "v_proj": (args.dim, args.n_kv_heads * hs), "o_proj": (args.n_heads * hs, args.dim),
        "gate_proj": (args.dim, args.intermediate_size), "up_proj": (args.dim, args.intermediate_size),
        "down_proj": (args.intermediate_size, args.dim),
    }
    found: dict[tuple[int, str], dict[str, Tensor]] = {}
    try:
        with safe_open(str(config.weights), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                m = _KEY.match(key)
                if m is None:
                    raise bad(f"weight {key!r} is not a LoRA matrix of a block projection (only "
                              f"{', '.join(dims)} are supported)")
                layer, proj, which = int(m.group(1)), m.group(3), m.group(4)
                if layer >= args.n_layers:
                    raise bad(f"weight {key!r}: the model has {args.n_layers} layers")
                found.setdefault((layer, proj), {})[which] = f.get_tensor(key)
    except SafetensorError as exc:
        raise bad(f"{config.weights.name} is not a readable safetensors file ({exc})") from exc
    if not found:
        raise bad(f"{config.weights.name} holds no LoRA matrices")
    for (layer, proj), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise bad(f"layer {layer} {proj} has lora_{'A' if 'A' not in ab else 'B'} missing")
        fan_in, fan_out = dims[proj]
        a, b = ab["A"], ab["B"]
        if a.shape != (config.r, fan_in) or b.shape != (fan_out, config.r):
            raise bad(f"layer {layer} {proj}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit this "
                      f"model with r={config.r} (expected {(config.r, fan_in)} / {(fan_out, config.r)})")
    adapter = LoraAdapter(config.name, config)
    scale = config.scale
    r = config.r
    for layer in range(args.n_layers):
        for module, projs in _FUSED.items():
            present = [p for p in projs if (layer, p) in found]
            if not present:
                continue
            widths = [dims[p][1] for p in projs]
            total_out = sum(widths)
            a_cat = torch.cat([found[(layer, p)]["A"].float() for p in present])  # (R, in)
            b_bd = torch.zeros(total_out, r * len(present))  # block-diagonal (out, R)
            for j, p in enumerate(present):
                start = sum(widths[:projs.index(p)])
                b_bd[start:start + dims[p][1], j * r:(j + 1) * r] = found[(layer, p)]["B"].float() * scale
            adapter.weights[(layer, module)] = (a_cat.t().contiguous().to(device=device, dtype=dtype),
                                                b_bd.t().contiguous().to(device=device, dtype=dtype))
    return adapter
