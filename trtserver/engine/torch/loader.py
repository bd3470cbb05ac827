"""Loading the PyTorch engine: where it runs (device, dtype, quantization, threads) and the model,
its cache and its adapters made ready as one ``EngineCore``.

    placement = place(config, manifest, "auto")
    loaded = load(engine_dir, config, placement, eos_token_ids=..., max_len=..., seed=..., adapters=...)
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trtserver.adapters import AdapterRegistry
from trtserver.allocator import release_freed_memory
from trtserver.config import ServerConfig
from trtserver.engine.torch.core import EngineCore
from trtserver.engine.torch.lora import LoraManager
from trtserver.errors import EngineError
from trtserver.manifest import Manifest

log = logging.getLogger("trtserver.engine.torch.engine")


@dataclass(frozen=True, slots=True)
class Placement:
    device: torch.device
    dtype: torch.dtype | None  # None: the faster of float32 and bfloat16 on this CPU, picked at load
    quantize: str | None  # "int8", "int4" or None


@dataclass(frozen=True, slots=True)
class Loaded:
    core: EngineCore
    lora: LoraManager | None
    dtype: torch.dtype


def place(config: ServerConfig, manifest: Manifest, quantize: str) -> Placement:
    """Device, dtype and quantization (``quantize``: "auto", "none", "int8", "int4"); raises for
    combinations that cannot run. A batch-invariant CPU server takes bfloat16 only where its GEMMs are
    row-invariant (``weights.bf16_rows_invariant``)."""
    device = resolve_device(config.device)
    dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
    if quantize == "auto":
        quantize = auto_quantization(config, manifest, device, dtype)
    chosen = None if quantize == "none" else quantize
    if chosen == "int8":
        if device.type != "cpu" or dtype not in (None, torch.bfloat16):
            raise ValueError("quantize='int8' needs device cpu and dtype bfloat16 (or auto)")
        dtype = torch.bfloat16
    elif chosen == "int4" and (device.type != "cpu" or dtype not in (None, torch.bfloat16, torch.float32)):
        raise ValueError("quantize='int4' needs device cpu and dtype bfloat16, float32 or auto")
    if dtype is None and device.type == "cuda":
        dtype = torch.bfloat16
    if config.batch_invariant and device.type == "cpu" and dtype in (None, torch.bfloat16):
        from trtserver.engine.torch.cpu.weights import bf16_rows_invariant

        if not bf16_rows_invariant():
            if dtype == torch.bfloat16:
                raise ValueError("batch_invariant and dtype='bfloat16': this CPU's bfloat16 GEMMs round a row by "
                                 "its place in the batch; use dtype float32 (or auto) for batch invariance here")
            dtype = torch.float32  # auto: the float32 GEMMs keep a row's bits wherever it sits
    return Placement(device, dtype, chosen)


def auto_quantization(config: ServerConfig, manifest: Manifest, device: torch.device,
                      dtype: torch.dtype | None) -> str:
    """int4 on the CPU where the checkpoint's own weights are linear 4-bit blocks of 32 (a Q4 GGUF; for
    Q4_1, int4 reads the very values llama.cpp would) and the dtype is auto or bfloat16; otherwise none
    (float32 asked for is full precision). IQ4 types are not on a linear grid, so they do not count."""
    source = manifest.source.quantization or ""
    four_bit = source.upper().startswith("Q4")
    dtype_allows = dtype in (None, torch.bfloat16)
    return "int4" if device.type == "cpu" and dtype_allows and four_bit and not config.batch_invariant else "none"


def small_batch(config: ServerConfig, device: torch.device, dtype: torch.dtype, quantize: str | None,
                *, int4_kernel: bool = False) -> int:
    """Small decode batches take kernels of their own on the CPU (float32 attention, int4 / int8) where
    the model is in bfloat16 or quantized; never where every batch size must compute alike. Where the int4
    projections run the engine's own kernel (``cpu/int4.cpp``), every decode batch does: with the fused
    attention it beats the float32 weights at every batch size measured, up to 64 rows
    (docs/perf-decisions.md)."""
    from trtserver.engine.torch.model_runner import SMALL_BATCH

    on = device.type == "cpu" and (dtype == torch.bfloat16 or quantize is not None) and not config.batch_invariant
    return 0 if not on else max(config.max_batch_size, SMALL_BATCH) if int4_kernel else SMALL_BATCH


def thread_counts(config: ServerConfig, device: torch.device) -> tuple[int, int] | None:
    """Torch threads for (small, large) forwards (``EngineCore``). On CPU by default every core,
    with the model in its own process. With the model on a thread of the server
    (``--no-engine-process``) small decode batches get every core but one: their spinning
    threads would hold up the server's Python on the shared GIL, so a core is left to the event
    loop; prefill and larger decode batches, whose GEMMs pay for it, get every core. ``threads``
    alone sets both; ``batch_threads`` the second. A batch-invariant server keeps one count (the
    GEMMs' blocking may follow it)."""
    cores = os.cpu_count() or 1
    if device.type != "cpu":
        return (config.threads, config.threads) if config.threads > 0 else None
    small = config.threads or (cores if config.engine_process else max(1, cores - 1))
    large = small if config.batch_invariant else config.batch_threads or config.threads or cores
    return small, large



def load(path: Path, config: ServerConfig, placement: Placement, *, eos_token_ids: tuple[int, ...], max_len: int,
         seed: int | None, adapters: AdapterRegistry | None) -> Loaded:
    """Load the model and allocate the cache (blocking)."""
    from trtserver.engine.torch.model import load_model

    device = placement.device
    if device.type == "cpu":
        # oneDNN caches a primitive per GEMM shape (1024 by default), and ever-new batch and chunk
        # shapes would grow RSS with it; 256 holds the decode working set.
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")
    elif device.type == "cuda":
        torch.cuda.set_device(device)  # graphs capture and replay on the current device's streams
    threads = thread_counts(config, device)
    if threads is not None:
        torch.set_num_threads(threads[0])
    t0 = time.perf_counter()
    int4_kernel = placement.quantize == "int4" and device.type == "cpu" and uses_int4_kernel(path, adapters)
    # the int4 kernel's whole decode step is one call on a float32 model (cpu/decode_stack.py)
    dtype = placement.dtype or (torch.float32 if int4_kernel else pick_cpu_dtype())
    model = load_model(path, dtype, device)
    if placement.quantize is not None:
        from trtserver.engine.torch.cpu.weights import Int4Linear, quantize_weights

        quantize_weights(model, placement.quantize, int4_kernel=int4_kernel)
        head = model.output
        if int4_kernel and isinstance(head, Int4Linear) and head.kernel_layout:
            from trtserver.engine.torch.cpu.kernels import pick_int4_loop

            pick_int4_loop(head.packed, head.scales)  # at the decode's thread count, set above
    elif device.type == "cpu":
        from trtserver.engine.torch.cpu.weights import can_pack_for_cpu, pack_for_cpu

        if can_pack_for_cpu(dtype):
            pack_for_cpu(model)
    if device.type == "cpu":
        release_freed_memory()  # the float32 checkpoint read and cast: RSS otherwise kept
    lora = None
    if adapters is not None:
        lora = LoraManager(adapters, model.args, dtype, device)
        lora.install(model)
    decode = None
    if device.type == "cpu":
        from trtserver.engine.torch.cpu import accelerate

        decode = accelerate(model)
    small = small_batch(config, device, dtype, placement.quantize, int4_kernel=int4_kernel)
    core = EngineCore(model, num_slots=config.max_batch_size, max_len=max_len, chunk_size=config.prefill_chunk_size,
                      eos_token_ids=eos_token_ids, device=device, seed=seed, small_batch=small, threads=threads,
                      lora=lora, decode=decode,
                      prefix_cache=config.prefix_cache, cache_slots=config.prefix_cache_extra_slots)
    if device.type == "cuda" and config.cuda_graphs:
        from trtserver.engine.torch.graphs import capture_decode_graphs

        capture_decode_graphs(core.model_runner, all_rows=config.batch_invariant)
    log.info("torch engine: %s on %s as %s, %d slots x %d positions, loaded in %.1fs", path.name, device,
             str(dtype).removeprefix("torch."), config.max_batch_size, max_len, time.perf_counter() - t0)
    return Loaded(core, lora, dtype)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"device {name!r} was asked for but CUDA is not available")
    return device


@functools.cache
def pick_cpu_dtype() -> torch.dtype:
    """float32 or bfloat16, whichever decodes faster here: time decode-shaped GEMMs (1 and 8 rows)
    over six projection-sized weights in the layout the engine uses. Where /proc/cpuinfo lists
    native bf16 dot products (avx512_bf16 / AMX), bfloat16 without timing: it wins there, and on a
    busy machine the timing is noise."""
    from trtserver.engine.torch.cpu.weights import PackedLinear, can_pack_for_cpu

    if _cpu_has_bf16():
        log.info("dtype auto on CPU: bfloat16 (the CPU has native bf16 dot products)")
        return torch.bfloat16
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        layers = [torch.nn.Linear(576, 3072, bias=False, dtype=dtype) for _ in range(6)]
        fns = [PackedLinear(lin) for lin in layers] if can_pack_for_cpu(dtype) else layers
        xs = [torch.randn(rows, 576, dtype=dtype) for rows in (1, 8)]
        with torch.inference_mode():
            for fn in fns:
                fn(xs[0])
            t0 = time.perf_counter()
            for _ in range(3):
                for x in xs:
                    for fn in fns:
                        fn(x)
        times[dtype] = time.perf_counter() - t0
    choice = min(times, key=times.__getitem__)
    log.info("dtype auto on CPU: %s (float32 %.1f ms, bfloat16 %.1f ms)", str(choice).removeprefix("torch."),
             times[torch.float32] * 1e3, times[torch.bfloat16] * 1e3)
    return choice


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def _cpu_has_bf16() -> bool:
    flags = _cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def uses_int4_kernel(path: Path, adapters: AdapterRegistry | None) -> bool:
    """Whether int4 weights take ``int4.cpp``'s kernel here: where it wins, the model's widths fit its groups
    and the kernels build. A LoRA server's base rows take the ATen calls, which read ATen's int4 layout."""
    from trtserver.engine.torch.cpu import kernels
    from trtserver.engine.torch.cpu.weights import fits_int4_kernel
    from trtserver.engine.torch.model import ModelArgs

    if adapters is not None or not int4_kernel_wins():
        return False
    return fits_int4_kernel(ModelArgs.from_dir(path)) and kernels.load()


def int4_kernel_wins() -> bool:
    """Where ``int4.cpp``'s int4 beats ATen's: x86-64 with AVX2 and FMA, AVX-512 machines included (there it
    takes 512-bit dot products from two rows on; docs/perf-decisions.md); elsewhere it is unmeasured."""
    return {"avx2", "fma"} <= _cpu_flags()

