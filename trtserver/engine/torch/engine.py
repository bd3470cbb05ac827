"""``TorchEngine``: the portable engine (CPU, or CUDA without TensorRT-LLM).

    engine = TorchEngine(config)                       # a ServerConfig
    engine = TorchEngine.from_dir("engines/SmolLM2-135M-Instruct", dtype="float32")
    await engine.start()                               # loads the model (off the event loop)
    async for delta in engine.generate(request): ...   # closing early aborts the request
    await engine.shutdown()
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trtserver.adapters import AdapterRegistry
from trtserver.config import ServerConfig
from trtserver.engine.base import (
    Capabilities,
    EngineBase,
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

    from trtserver.engine.torch.core import EngineCore
    from trtserver.engine.torch.lora import LoraManager
    from trtserver.engine.torch.transport.process import EngineProcess
    from trtserver.engine.torch.transport.thread import EngineThread

log = logging.getLogger(__name__)


class TorchEngine(EngineBase):
    """With ``engine_process`` (the server's default) this object is the server's side only: it
    checks requests and hands them to the engine process, and it never imports torch, which would
    cost the server's process memory and start-up time. Device, dtype and quantization are settled
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
        self.tokenizer = Tokenizer.from_dir(self.path)
        self._quantize_asked = quantize
        self.device: torch.device | None = None  # these three are settled by _resolve()
        self.dtype: torch.dtype | None = None
        self.quantize: str | None = None
        self.dtype_name: str | None = None  # the dtype's name, in the server process too
        self.max_model_len = config.max_model_len or self.manifest.context_length
        self.seed = seed
        self.core: EngineCore | None = None  # in this process only (not with engine_process)
        self.runner: EngineThread | EngineProcess | None = None
        self.adapters: AdapterRegistry | None = None
        self.lora: LoraManager | None = None
        if config.adapters_dir is not None:
            self.adapters = AdapterRegistry(config.adapters_dir, max_rank=config.max_lora_rank)
        self.info = EngineInfo(
            model_name=config.served_model_name or self.manifest.served_model_name,
            context_length=self.max_model_len,
            vocab_size=int(self.model_config["vocab_size"]),
            eos_token_ids=self.tokenizer.eos_token_ids,
            capabilities=Capabilities(max_logprobs=max(20, config.max_logprobs),
                                      adapters=config.adapters_dir is not None,
                                      prefix_caching=config.prefix_cache),
            fingerprint_inputs={**{k: getattr(self.manifest, k) for k in ("served_model_name", "weights_sha256",
                                                                          "dtype", "format", "format_version")},
                                "quantization": quantize, "batch_invariant": config.batch_invariant},
            backend="torch",
        )
        if not config.engine_process:
            self._resolve()

    def _resolve(self) -> None:
        """Device, dtype and quantization, which need torch; raises for combinations that cannot run."""
        from trtserver.engine.torch.loader import place

        placement = place(self.config, self.manifest, self._quantize_asked)
        self.device, self.dtype, self.quantize = placement.device, placement.dtype, placement.quantize
        self._settled(self.quantize)

    def _threads(self) -> tuple[int, int] | None:
        from trtserver.engine.torch.loader import thread_counts

        assert self.device is not None
        return thread_counts(self.config, self.device)

    def _settled(self, quantize: str | None) -> None:
        """What the fingerprint reports is the quantization that runs, not the one asked for."""
        self.info = replace(self.info, fingerprint_inputs={**self.info.fingerprint_inputs,
                                                             "quantization": quantize or "none"})

    @classmethod
    def from_dir(cls, engine_dir: str | Path, *, seed: int | None = None, quantize: str | None = None,
                 **options: Any) -> TorchEngine:
        """Options are ServerConfig fields: ``device``, ``dtype``, ``max_batch_size``, ..."""
        options.setdefault("engine_process", False)  # in process: tests and benchmarks reach engine.core
        return cls(ServerConfig(engine_dir=str(engine_dir), engine="torch", **options), seed=seed, quantize=quantize)

    # ---- life cycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if self.runner is not None:
            return
        if self.config.engine_process:
            from trtserver.engine.torch.transport.process import EngineProcess

            runner = EngineProcess(self.config, seed=self.seed, quantize=self._quantize_asked,
                                   tokenizer=self.tokenizer)
            await runner.start()
            assert runner.report is not None
            self.dtype_name = runner.report.dtype
            self.quantize = runner.report.quantization
            self._settled(self.quantize)
            self.runner = runner
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.load)
        from trtserver.engine.torch.transport.thread import EngineThread

        assert self.core is not None
        in_process = EngineThread(self.core)
        in_process.start()
        self.runner = in_process

    def load(self) -> None:
        """Load the model and allocate the cache (blocking; ``start`` runs it in a thread)."""
        from trtserver.engine.torch.loader import Placement, load

        if self.device is None:  # in the engine process: settled here, where the model loads
            self._resolve()
        assert self.device is not None
        loaded = load(self.path, self.config, Placement(self.device, self.dtype, self.quantize),
                      eos_token_ids=self.info.eos_token_ids, max_len=self.max_model_len, seed=self.seed,
                      adapters=self.adapters)
        self.core, self.lora, self.dtype = loaded.core, loaded.lora, loaded.dtype
        self.dtype_name = str(loaded.dtype).removeprefix("torch.")

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
        return runner is not None and runner.threads_bound and runner.report is not None \
            and runner.report.device == "cpu"

    @property
    def failure(self) -> str | None:
        """Why the engine process died under the server, if it did (``/health`` reports it)."""
        return self.runner.failure if self.runner is not None else None

    def stats(self) -> EngineStats:
        if self.runner is None:
            return EngineStats(slots_total=self.config.max_batch_size)
        return self.runner.stats
