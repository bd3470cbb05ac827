"""``TorchEngine``: the portable engine (CPU, or CUDA without TensorRT-LLM).

    engine = TorchEngine(config)                       # a ServerConfig
    engine = TorchEngine.from_dir("engines/SmolLM2-135M-Instruct", dtype="float32")
    await engine.start()                               # loads the model (off the event loop)
    async for delta in engine.generate(request): ...   # closing early aborts the request
    await engine.shutdown()
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trtserver.adapters import AdapterRegistry
from trtserver.config import ServerConfig
from trtserver.engine.base import (
    Capabilities,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    SequenceOutput,
)
from trtserver.errors import ContextLengthExceeded, EngineError, InvalidRequest, Overloaded, Unsupported
from trtserver.manifest import Manifest, load_manifest
from trtserver.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class TorchEngine:
    """With ``engine_process`` (the server's default) this object is the server's side only: it
    checks requests and hands them to the engine process, and it never imports torch (~250 MiB of
    the server's memory and a second of its start-up). Device, dtype and quantization are settled
    where the model is loaded: in ``load()``, here or in the engine process, which reports them."""

    def __init__(self, config: ServerConfig, *, seed: int | None = None, quantize: str | None = None) -> None:
        """``quantize`` ("auto", "none", "int8" or "int4"; default ``config.quantization``): weight-only
        int8 or int4 projections for small decode batches on the CPU, with bfloat16 activations."""
        quantize = quantize or config.quantization
        if quantize not in ("auto", "none", "int8", "int4"):
            raise ValueError(f"quantize={quantize!r}: one of 'auto', 'none', 'int8', 'int4'")
        if config.batch_invariant and quantize in ("int8", "int4"):
            raise ValueError(f"quantize={quantize!r} and batch_invariant: the quantized kernels serve only small "
                             "batches, so a request's tokens would depend on its neighbours; choose one")
        self.config = config
        self.path = Path(config.engine_dir)
        if not (self.path / "config.json").exists():
            raise FileNotFoundError(f"{self.path}: no config.json; build the engine directory with `make engines`")
        self.model_config: dict[str, Any] = json.loads((self.path / "config.json").read_text())
        self.manifest: Manifest = load_manifest(self.path)
        self._tokenizer = Tokenizer.from_dir(self.path)
        self._quantize_asked = quantize
        self.device: torch.device | None = None  # these three are settled by _resolve()
        self.dtype: torch.dtype | None = None
        self.quantize: str | None = None
        self.dtype_name: str | None = None  # the dtype's name, in the server process too
        self.max_model_len = config.max_model_len or self.manifest.context_length
        self.seed = seed
        self.core: Any = None
        self.runner: Any = None
        self.adapters: AdapterRegistry | None = None
        self.lora: Any = None  # LoraManager once loaded
        if config.adapters_dir is not None:
            self.adapters = AdapterRegistry(config.adapters_dir, max_rank=config.max_lora_rank)
        self._info = EngineInfo(
            model_name=config.served_model_name or self.manifest.served_model_name,
            context_length=self.max_model_len,
            vocab_size=int(self.model_config["vocab_size"]),
            eos_token_ids=self._tokenizer.eos_token_ids,
            capabilities=Capabilities(max_logprobs=max(20, config.max_logprobs),
                                      adapters=config.adapters_dir is not None),
            fingerprint_inputs={**{k: getattr(self.manifest, k) for k in ("served_model_name", "weights_sha256",
                                                                          "dtype", "format", "format_version")},
                                "quantization": quantize, "batch_invariant": config.batch_invariant},
            backend="torch",
        )
        if not config.engine_process:
            self._resolve()

    def _resolve(self) -> None:
        """Device, dtype and quantization, which need torch; raises for combinations that cannot run."""
        import torch

        self.device = resolve_device(self.config.device)
        self.dtype = None if self.config.dtype == "auto" else getattr(torch, self.config.dtype)
        quantize = self._quantize_asked
        if quantize == "auto":
            quantize = self._auto_quantization()
        self.quantize = None if quantize == "none" else quantize
        if self.quantize is not None:
            if self.device.type != "cpu" or self.dtype not in (None, torch.bfloat16):
                raise ValueError(f"quantize={self.quantize!r} needs device cpu and dtype bfloat16 (or auto)")
            self.dtype = torch.bfloat16
        if self.dtype is None and self.device.type == "cuda":
            self.dtype = torch.bfloat16
        self._settled(self.quantize)

    def _settled(self, quantize: str | None) -> None:
        """What the fingerprint reports is the quantization that runs, not the one asked for."""
        self._info = replace(self._info, fingerprint_inputs={**self._info.fingerprint_inputs,
                                                             "quantization": quantize or "none"})

    def _auto_quantization(self) -> str:
        """int4 where the checkpoint's own weights are linear 4-bit blocks of 32 (a Q4 GGUF; for Q4_1,
        int4 reads the very values llama.cpp would) and the CPU computes in bfloat16; otherwise none.
        IQ4 types are not on a linear grid, so they do not count."""
        import torch

        assert self.device is not None
        source = self.manifest.source.quantization or ""
        bf16 = self.dtype == torch.bfloat16 or (self.dtype is None and _cpu_has_bf16())
        four_bit = source.upper().startswith("Q4")
        return "int4" if self.device.type == "cpu" and bf16 and four_bit and not self.config.batch_invariant \
            else "none"

    def _small_batch(self, dtype: torch.dtype) -> int:
        """Small decode batches take kernels of their own on a bfloat16 CPU (measured there: float32
        attention, int4); never where every batch size must compute alike."""
        import torch

        from trtserver.engine.torch.model import SMALL_BATCH

        assert self.device is not None
        on = self.device.type == "cpu" and dtype == torch.bfloat16 and not self.config.batch_invariant
        return SMALL_BATCH if on else 0

    def _threads(self) -> tuple[int, int] | None:
        """Torch threads for (small, large) forwards (``EngineCore``). On CPU by default every core,
        with the model in its own process. With the model on a thread of the server
        (``--no-engine-process``) small decode batches get every core but one: their spinning
        threads held up the server's Python on the shared GIL (1 stream 30-38 tokens/s on two
        threads, 48-53 on one), so a core is left to the event loop; prefill and larger decode
        batches, whose GEMMs pay for it, get every core. ``threads`` alone sets both;
        ``batch_threads`` the second. A batch-invariant server keeps one count (the GEMMs'
        blocking may follow it)."""
        config, cores = self.config, os.cpu_count() or 1
        assert self.device is not None
        if self.device.type != "cpu":
            return (config.threads, config.threads) if config.threads > 0 else None
        small = config.threads or (cores if config.engine_process else max(1, cores - 1))
        large = small if config.batch_invariant else config.batch_threads or config.threads or cores
        return small, large

    @classmethod
    def from_dir(cls, engine_dir: str | Path, *, seed: int | None = None, quantize: str | None = None,
                 **options: Any) -> TorchEngine:
        """Options are ServerConfig fields: ``device``, ``dtype``, ``max_batch_size``, ..."""
        options.setdefault("engine_process", False)  # in process: tests and benchmarks reach engine.core
        return cls(ServerConfig(engine_dir=str(engine_dir), engine="torch", **options), seed=seed, quantize=quantize)

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    # ---- life cycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if self.runner is not None:
            return
        if self.config.engine_process:
            from trtserver.engine.torch.process import EngineProcess

            runner = EngineProcess(self.config, seed=self.seed, quantize=self._quantize_asked,
                                   tokenizer=self._tokenizer)
            await runner.start()
            assert runner.report is not None
            self.dtype_name = runner.report.dtype
            self.quantize = runner.report.quantization
            self._settled(self.quantize)
            self.runner = runner
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.load)
        from trtserver.engine.torch.runner import Runner

        self.runner = Runner(self.core)
        self.runner.start()

    def load(self) -> None:
        """Load the model and allocate the cache (blocking; ``start`` runs it in a thread)."""
        import torch

        from trtserver.engine.torch.core import EngineCore
        from trtserver.engine.torch.model import load_model

        if self.device is None:  # in the engine process: settled here, where the model loads
            self._resolve()
        assert self.device is not None
        if self.device.type == "cpu":
            # oneDNN caches a primitive per GEMM shape (1024 by default); with ever-new batch and chunk
            # shapes that cache is what grew RSS under a soak. 256 holds the decode working set.
            os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")
        elif self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # graphs capture and replay on the current device's streams
        threads = self._threads()
        if threads is not None:
            torch.set_num_threads(threads[0])
        t0 = time.perf_counter()
        dtype = self.dtype or pick_cpu_dtype()
        model = load_model(self.path, dtype, self.device)
        if self.quantize is not None:
            from trtserver.engine.torch.cpu_weights import quantize_weights

            quantize_weights(model, self.quantize)
        elif self.device.type == "cpu":
            from trtserver.engine.torch.cpu_weights import can_pack_for_cpu, pack_for_cpu

            if can_pack_for_cpu(dtype):
                pack_for_cpu(model)
        self.dtype = dtype
        self.dtype_name = str(dtype).removeprefix("torch.")
        if self.device.type == "cpu":
            _release_freed_memory()  # the float32 checkpoint read and cast: ~50 MB of RSS otherwise kept
        if self.adapters is not None:
            from trtserver.engine.torch.lora import LoraManager

            self.lora = LoraManager(self.adapters, model.args, dtype, self.device)
            self.lora.install(model)
        if self.device.type == "cpu":
            from trtserver.engine.torch.scripted import build

            model.scripted = build(model)
        self.core = EngineCore(model, num_slots=self.config.max_batch_size, max_len=self.max_model_len,
                               chunk_size=self.config.prefill_chunk_size, eos_token_ids=self._info.eos_token_ids,
                               device=self.device, seed=self.seed, small_batch=self._small_batch(dtype),
                               threads=threads)
        self.core.lora = self.lora
        if self.device.type == "cuda" and self.config.cuda_graphs:
            from trtserver.engine.torch.graphs import capture_decode_graphs

            capture_decode_graphs(self.core, all_rows=self.config.batch_invariant)
        log.info("torch engine: %s on %s as %s, %d slots x %d positions, loaded in %.1fs", self.path.name,
                 self.device, str(dtype).removeprefix("torch."), self.config.max_batch_size,
                 self.max_model_len, time.perf_counter() - t0)

    async def shutdown(self) -> None:
        if self.runner is not None:
            await self.runner.stop()
            self.runner = None

    # ---- requests -----------------------------------------------------------------------------
    def generate(self, request: GenerationRequest) -> AsyncIterator[SequenceOutput]:
        if self.runner is None:
            raise EngineError("the engine is not started")
        prompt_len = len(request.prompt_token_ids)
        if prompt_len > self.max_model_len:
            raise ContextLengthExceeded(
                f"the prompt has {prompt_len} tokens; this model's context is {self.max_model_len}", param="prompt")
        if max(1, request.n) > self.config.max_batch_size:
            raise InvalidRequest(f"n={request.n} exceeds the engine's {self.config.max_batch_size} sequence slots",
                                 param="n")
        if request.adapter is not None:  # 404 / 400 now, before the request is queued
            if self.adapters is None:
                raise Unsupported("LoRA adapters are not enabled on this server; start it with --adapters-dir",
                                  param="peft")
            if self.lora is None or not self.lora.is_loaded(request.adapter):
                self.adapters.load_config(request.adapter)  # the engine loads the weights, off its step loop
        if self.stats().waiting >= self.config.max_waiting:
            raise Overloaded("too many requests are waiting; retry later")
        return self.runner.generate(request, max(1, request.n))

    def abort(self, request_id: str, index: int | None = None) -> None:
        if self.runner is not None:
            self.runner.abort(request_id, index)

    @property
    def threads_bound(self) -> bool:
        """The engine process runs on the CPU with its threads bound one per CPU (``--pin-threads``);
        ``trtserver serve`` then pins its event loop."""
        runner = self.runner
        report = getattr(runner, "report", None)
        return bool(getattr(runner, "threads_bound", False) and report is not None and report.device == "cpu")

    @property
    def failure(self) -> str | None:
        """Why the engine process died under the server, if it did (``/health`` reports it)."""
        return getattr(self.runner, "failure", None)

    def stats(self) -> EngineStats:
        stats = getattr(self.runner, "stats", None)
        if isinstance(stats, EngineStats):  # the engine process reports them with every step
            return stats
        if self.core is None:
            return EngineStats(slots_total=self.config.max_batch_size)
        return self.core.stats()  # type: ignore[no-any-return]


def resolve_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"device {name!r} was asked for but CUDA is not available")
    return device


@functools.cache
def pick_cpu_dtype() -> torch.dtype:
    """float32 or bfloat16, whichever decodes faster here: time decode-shaped GEMMs (1 and 8 rows)
    over ~40 MB of weights in the layout the engine uses. bfloat16 wins where the CPU has native
    bf16 dot products (avx512_bf16 / AMX: about 1.9x on this model); elsewhere float32 does.
    Where /proc/cpuinfo lists those, bfloat16 without timing: on a busy machine the timing is noise
    (it picked float32 on a loaded avx512_bf16 box, which then decoded at half speed), and it
    costs ~1 s of start-up."""
    import torch

    from trtserver.engine.torch.cpu_weights import PackedLinear, can_pack_for_cpu

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


def _release_freed_memory() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _cpu_has_bf16() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags

