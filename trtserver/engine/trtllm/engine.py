"""``TrtllmEngine``: the ``Engine`` over TensorRT-LLM's LLM API.

The generation (1.x prebuilt engine, 1.x PyTorch backend, 0.12–0.21, v0.12.0-jetson) is probed at
run time (``version``); what each request field becomes is the table in ``mapping`` (also rendered
into ``docs/deploy.md``). The executor already does in-flight batching, paged KV cache and CUDA
graphs; this module only translates requests and streams.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import os
import pickle
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from trtserver.engine.base import (
    Capabilities,
    EngineBase,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    SequenceOutput,
)
from trtserver.engine.trtllm.mapping import needs_logits_processor, refusals
from trtserver.engine.trtllm.request import generate_kwargs, guided_kwargs, llm_kwargs, prepare
from trtserver.engine.trtllm.stream import StreamTranslator
from trtserver.engine.trtllm.version import (
    ApiFeatures,
    BuildFacts,
    class_fields,
    detect,
    guided_params_class,
    kv_cache_config_class,
    llm_class,
    lora_request_class,
    request_error_class,
    sampling_params_class,
)
from trtserver.errors import APIError, EngineError, InvalidRequest, Overloaded, Unsupported
from trtserver.manifest import Manifest, load_manifest
from trtserver.tokenizer import Tokenizer

if TYPE_CHECKING:
    from types import ModuleType

    from trtserver.config import ServerConfig

__all__ = ["TrtllmEngine"]

log = structlog.get_logger("trtserver.engine")

# the executor's own words for a full queue or cache (executorImpl.cpp: "... please try again later")
_BUSY = re.compile(r"try again later|queue size|queue is full|cache is full|no free", re.IGNORECASE)
_ABORT = object()
_MAX_LORAS = 8  # adapters resident on the GPU
_MAX_CPU_LORAS = 16  # adapters cached in host memory
_DONE = object()


@dataclass(slots=True)
class _Active:
    request: GenerationRequest
    queue: asyncio.Queue[Any]
    abortable: bool
    output: Any = None
    pump: asyncio.Task[None] | None = None
    cancelled: set[int] = field(default_factory=set)
    aborted: bool = False


def _hf_vocab_size(model_dir: Path) -> int:
    """``vocab_size`` of the model's HF ``config.json`` (what the PyTorch backend loads)."""
    try:
        return int(json.loads((model_dir / "config.json").read_text()).get("vocab_size") or 0)
    except (OSError, ValueError, AttributeError):
        return 0


def _shutdown_when_built(building: asyncio.Future[Any]) -> None:
    if not building.cancelled() and building.exception() is None:
        llm = building.result()
        if hasattr(llm, "shutdown"):
            llm.shutdown()


class TrtllmEngine(EngineBase):
    """``Engine`` over TensorRT-LLM's LLM API."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.engine_path = Path(config.engine_dir)
        self.manifest: Manifest = load_manifest(self.engine_path)
        tokenizer_dir = (self.engine_path / self.manifest.tokenizer).parent
        self.tokenizer = Tokenizer.from_dir(tokenizer_dir)
        self.tokenizer_dir = tokenizer_dir
        self.trt_engine_dir: Path | None = None
        build = BuildFacts()
        if self.manifest.trtllm is not None:
            self.trt_engine_dir = self.engine_path / self.manifest.trtllm.engine_dir
            build = BuildFacts.from_config(json.loads((self.trt_engine_dir / "config.json").read_text()))
        # the model's vocabulary (the logits' width without padding); 0 when unknown
        self.model_vocab_size = build.vocab_size or _hf_vocab_size(self.engine_path)
        self.build = build
        self.tp = config.tensor_parallel_size
        self.pp = config.pipeline_parallel_size
        self._llm: Any = None
        self._active: dict[str, _Active] = {}
        self._pumps: set[asyncio.Task[None]] = set()
        self._lora_ids: dict[str, int] = {}
        self._cache_hit_tokens = 0  # prompt tokens whose K/V blocks TensorRT-LLM reused, since start
        self._cache_miss_tokens = 0

    @cached_property
    def trtllm(self) -> ModuleType:
        """``tensorrt_llm`` (imported in ``start()``'s worker thread, or on first use before it)."""
        return importlib.import_module("tensorrt_llm")

    @cached_property
    def features(self) -> ApiFeatures:
        features = detect(self.trtllm, has_engine=self.trt_engine_dir is not None, build=self.build)
        gather = (self.config.trtllm_gather_generation_logits
                  or self.build.gather_generation_logits)
        return features.with_options(
            gather_generation_logits=gather and features.llm_accepts("gather_generation_logits"),
            guided_backend=self._guided_backend(features),
            lora_enabled=self.config.adapters_dir is not None and features.lora,
            pytorch_beam_width=self.config.trtllm_max_beam_width,
            block_reuse=self._block_reuse(features))

    @property
    def info(self) -> EngineInfo:
        return self._engine_info

    @info.setter
    def info(self, value: EngineInfo) -> None:
        self.__dict__["_engine_info"] = value  # where the cached property keeps it

    @cached_property
    def _engine_info(self) -> EngineInfo:  # on first use: it reads the engine's files
        return self._make_info()

    # --- Engine protocol ---------------------------------------------------------------------

    async def start(self) -> None:
        """Import TensorRT-LLM and build its ``LLM`` (which loads the engine, for minutes) in a worker
        thread, so the event loop goes on answering ``/health`` with "loading" meanwhile."""
        if self._llm is not None:
            return
        loop = asyncio.get_running_loop()
        building = loop.run_in_executor(None, self._build_llm)
        try:
            self._llm = await asyncio.shield(building)
        except asyncio.CancelledError:
            building.add_done_callback(_shutdown_when_built)  # the server stopped while it loaded
            raise

    def _build_llm(self) -> Any:
        if self.tp * self.pp == 1:
            # in-process executor worker: our per-request logits processors need not be pickled
            os.environ.setdefault("TLLM_WORKER_USE_SINGLE_PROCESS", "1")
        os.environ.setdefault("TLLM_ALLOW_N_GREEDY_DECODING", "1")  # greedy n>1: serving asked for it
        cls = llm_class(self.trtllm, self.features.generation)
        self._engine_info  # noqa: B018 - probed here, off the event loop
        model = str(self.trt_engine_dir or self.engine_path)
        kwargs = llm_kwargs(self.features, tokenizer_dir=str(self.tokenizer_dir), tp=self.tp, pp=self.pp,
                            lora=self._lora_llm_kwargs(), kv_cache_config=self._kv_cache_config())
        return cls(model=model, **kwargs)

    async def shutdown(self) -> None:
        for request_id in list(self._active):
            self.abort(request_id)
        llm, self._llm = self._llm, None
        if llm is not None and hasattr(llm, "shutdown"):
            await asyncio.to_thread(llm.shutdown)

    def check(self, request: GenerationRequest) -> list[tuple[str, str]]:
        """``(param, reason)`` for what this TensorRT-LLM cannot do in ``request`` (empty: servable)."""
        found = refusals(request, self.features)
        if request.adapter is not None and not found:
            try:
                self._adapter_path(request.adapter)
            except InvalidRequest as exc:
                found.append(("peft", exc.message))
        return found

    def generate(self, request: GenerationRequest) -> AsyncIterator[SequenceOutput]:
        return self._generate(request)

    def abort(self, request_id: str, index: int | None = None) -> None:
        active = self._active.get(request_id)
        if active is None:
            return
        if index is None:
            active.cancelled.update(range(active.request.n))
        else:
            active.cancelled.add(index)
        if len(active.cancelled) >= active.request.n:
            self._cancel(active)
        active.queue.put_nowait(_ABORT)

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self._active), slots_total=self.features.build.max_batch_size,
                           prefix_cache_hit_tokens=self._cache_hit_tokens,
                           prefix_cache_miss_tokens=self._cache_miss_tokens)

    # --- internals ---------------------------------------------------------------------------

    def _guided_backend(self, f: ApiFeatures) -> str | None:
        """The guided-decoding backend to start TRT-LLM with; None: our guides run in a logits processor."""
        wanted = self.config.trtllm_guided_decoding_backend
        if not wanted or not f.has_guided_params:
            return None
        # TRT: anything but xgrammar raises at LLM(); PyTorch: a Literal["xgrammar", "llguidance"] field
        accepted = ("xgrammar",) if f.trt_backend else ("xgrammar", "llguidance")
        if wanted not in accepted:
            log.warning("trtllm_guided_backend_not_passed", backend=wanted, accepted=accepted,
                        reason=f"TensorRT-LLM's {'TensorRT' if f.trt_backend else 'PyTorch'} backend "
                               "accepts only these")
            return None
        if importlib.util.find_spec(wanted) is None:
            log.warning("trtllm_guided_backend_not_passed", backend=wanted, reason="it is not importable")
            return None
        return str(wanted)

    def _block_reuse(self, f: ApiFeatures) -> bool:
        """Ask for KV-cache block reuse: the server's prefix_cache, where KvCacheConfig has the setting
        and, on a TensorRT engine, the engine was not built without paged context attention."""
        if not self.config.prefix_cache or not f.block_reuse_setting:
            return False
        if f.trt_backend and f.build.paged_context_fmha is False:
            log.info("trtllm_block_reuse_off", reason="the engine was built without use_paged_context_fmha")
            return False
        return True

    def _kv_cache_config(self) -> Any:
        """``KvCacheConfig(enable_block_reuse=...)`` set either way: the default differs by version."""
        if not self.features.block_reuse_setting:
            return None
        cls = kv_cache_config_class(self.trtllm)
        assert cls is not None
        return cls(enable_block_reuse=self.features.block_reuse)

    def _make_info(self) -> EngineInfo:
        f = self.features
        eos = self.tokenizer.eos_token_ids
        context = self.manifest.context_length
        if f.build.max_seq_len:
            context = min(context, f.build.max_seq_len)
        vocab = self.model_vocab_size or self.tokenizer.vocab_size
        beam = f.max_beam_width > 1 and (
            "use_beam_search" in f.sampling_fields or "beam_width" in f.sampling_fields)
        if f.trt_backend:
            gathered = f.gather_generation_logits or f.logits_logprobs
            max_logprobs = self.config.max_logprobs if gathered else 0
        else:
            max_logprobs = self.config.max_logprobs if f.release >= (1, 1, 0) else 0
        prompt_lp = f.build.gather_context_logits or not f.trt_backend
        caps = Capabilities(
            prompt_logprobs="return_context_logits" in f.sampling_fields and prompt_lp,
            beam_search=beam,
            logits_processors=f.dynamic_logits_processor,
            guided_decoding=f.dynamic_logits_processor or f.guided_backend is not None,
            multiple_sequences=f.multiple_sequences,
            abort=f.has_abort,
            priority=f.priority,
            adapters=f.lora_enabled,
            max_logprobs=max_logprobs,
            prefix_caching=f.block_reuse and f.reports_cached_tokens,
        )
        fingerprint: dict[str, Any] = {"trtllm_version": f.version, "trtllm_generation": f.generation.value,
                                       "weights_sha256": self.manifest.weights_sha256}
        if self.manifest.trtllm is not None:
            fingerprint["trtllm_build_args"] = self.manifest.trtllm.build_args
        return EngineInfo(model_name=self.config.served_model_name or self.manifest.served_model_name,
                          context_length=context, vocab_size=vocab, eos_token_ids=eos, capabilities=caps,
                          fingerprint_inputs=fingerprint, backend="trtllm")

    def _adapter_path(self, name: str) -> Path:
        root = self.config.adapters_dir
        if root is None:
            raise Unsupported("no adapters directory is configured (adapters_dir)", param="peft")
        path = (Path(root) / name).resolve()
        if Path(root).resolve() not in path.parents or not path.is_dir():
            raise InvalidRequest(f"adapter {name!r} is not in the adapters directory", param="peft")
        return path

    def _lora_llm_kwargs(self) -> dict[str, Any] | None:
        """LoRA keywords for ``LLM()``: a ``lora_config`` where the args have one (1.x), else the flat
        ``enable_lora`` / ``max_lora_rank`` / ``max_loras`` / ``max_cpu_loras`` (0.14–0.18)."""
        f = self.features
        if not f.lora_enabled or (f.trt_backend and not f.build.lora_plugin):
            return None
        rank = int(getattr(self.config, "max_lora_rank", 64))
        if not f.llm_accepts("lora_config"):
            flat = {"enable_lora": True, "max_lora_rank": rank, "max_loras": _MAX_LORAS,
                    "max_cpu_loras": _MAX_CPU_LORAS}
            return {k: v for k, v in flat.items() if f.llm_accepts(k) or f.llm_args is None}
        out: dict[str, Any] = {"enable_lora": True} if f.trt_backend and f.llm_accepts("enable_lora") else {}
        if f.trt_backend and not f.build.lora_target_modules:
            return out  # the engine's own lora_config then sizes the adapter cache
        try:
            lora_config_cls = importlib.import_module(f"{self.trtllm.__name__}.lora_manager").LoraConfig
        except (ImportError, AttributeError):
            return out
        adapters = sorted(str(p) for p in Path(str(self.config.adapters_dir)).iterdir() if p.is_dir())
        wanted: dict[str, Any] = {"lora_dir": adapters, "max_lora_rank": rank, "max_loras": _MAX_LORAS,
                                  "max_cpu_loras": _MAX_CPU_LORAS}
        if f.trt_backend:
            # ours overrides the engine's: keep the modules it was built for, or the cache is sized 0
            wanted.update(lora_target_modules=list(f.build.lora_target_modules),
                          trtllm_modules_to_hf_modules=dict(f.build.lora_modules_to_hf))
            if f.build.max_lora_rank:
                wanted["max_lora_rank"] = f.build.max_lora_rank
        known = class_fields(lora_config_cls)
        out["lora_config"] = lora_config_cls(**{k: v for k, v in wanted.items() if k in known})
        return out

    def _sampling_params(self, request: GenerationRequest) -> tuple[Any, Any]:
        f = self.features
        eos = self.tokenizer.eos_token_ids
        prep = prepare(request, f, eos_ids=eos)
        kw = prep.kwargs
        guided = guided_kwargs(request, f)
        if guided is not None:
            gd_cls = guided_params_class(self.trtllm)
            assert gd_cls is not None
            kw["guided_decoding"] = gd_cls(**guided)
        s = request.sampling
        if prep.embedding_bias is not None or prep.allowed_only is not None:
            kw["embedding_bias"] = self._embedding_bias(prep.embedding_bias or [], prep.allowed_only)
        if needs_logits_processor(request, f):
            from trtserver.engine.trtllm.logits import TrtllmLogitsProcessor

            in_bias = "embedding_bias" in kw
            processor = TrtllmLogitsProcessor(
                guided=None if guided is not None else request.guided, processors=request.logits_processors,
                logit_bias=() if in_bias else s.logit_bias,
                allowed_token_ids=None if in_bias else s.allowed_token_ids, eos_ids=eos)
            if os.environ.get("TLLM_WORKER_USE_SINGLE_PROCESS") != "1":
                try:
                    pickle.dumps(processor)
                except Exception as exc:  # noqa: BLE001 - any pickling failure means the same
                    raise Unsupported(f"this request's guide or logits processors cannot be sent to "
                                      f"TensorRT-LLM's worker process: {exc}",
                                      param="logits_processors") from exc
            kw["logits_processor"] = processor
        try:
            params = sampling_params_class(self.trtllm)(**kw)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"TensorRT-LLM {f.version} rejected the sampling parameters: {exc}") from exc
        for name, value in prep.attrs.items():
            setattr(params, name, value)
        return params, prep

    def _embedding_bias(self, pairs: list[tuple[int, float]], allowed: tuple[int, ...] | None) -> Any:
        import torch

        # TRT-LLM checks the length against the model's vocab_size (not the tokenizer's)
        bias = torch.zeros(self.info.vocab_size, dtype=torch.float32)
        if allowed is not None:
            bias.fill_(float("-inf"))
            bias[list(allowed)] = 0.0
        for tok, value in pairs:
            bias[tok] += value
        return bias

    def _lora_request(self, name: str) -> Any:
        cls = lora_request_class(self.trtllm)
        if cls is None:
            raise Unsupported(f"TensorRT-LLM {self.features.version} has no LoRARequest", param="peft")
        path = self._adapter_path(name)
        lora_id = self._lora_ids.setdefault(name, len(self._lora_ids) + 1)
        return cls(name, lora_id, str(path))

    async def _generate(self, request: GenerationRequest) -> AsyncIterator[SequenceOutput]:
        if self._llm is None:
            raise EngineError("the TensorRT-LLM engine is not started")
        problems = self.check(request)
        if problems:
            param, reason = problems[0]
            raise Unsupported(reason, param=param)
        if request.request_id in self._active:
            raise InvalidRequest(f"request id {request.request_id!r} is already running", param="request_id")
        params, prep = self._sampling_params(request)
        extra = generate_kwargs(request, self.features)
        if request.adapter is not None:
            extra["lora_request"] = self._lora_request(request.adapter)
        translator = StreamTranslator(request, eos_ids=self.tokenizer.eos_token_ids,
                                      our_stop_ids=prep.our_stop_ids, max_tokens=prep.max_tokens,
                                      has_finish_reason=self.features.finish_reason,
                                      vocab_size=self.model_vocab_size, logits_logprobs=prep.logits_logprobs,
                                      reports_cached_tokens=self.info.capabilities.prefix_caching)
        active = _Active(request=request, queue=asyncio.Queue(), abortable=prep.abortable)
        try:
            output = self._llm.generate_async(list(request.prompt_token_ids), sampling_params=params,
                                              streaming=prep.streaming, **extra)
        except (ValueError, TypeError) as exc:  # TRT-LLM's own per-request checks (_check_arguments)
            raise InvalidRequest(str(exc)) from exc
        except RuntimeError as exc:
            raise self._refused(exc) from exc
        active.output = output
        active.pump = asyncio.get_running_loop().create_task(self._pump(output, active.queue, prep.streaming))
        self._pumps.add(active.pump)
        active.pump.add_done_callback(self._pumps.discard)
        self._active[request.request_id] = active
        try:
            while not translator.finished:
                item = await active.queue.get()
                if item is _ABORT:
                    for index in sorted(active.cancelled):
                        if not translator.done[index]:
                            yield translator.finish(index, "abort")
                    continue
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise EngineError(f"TensorRT-LLM failed the request: {item}") from item
                for delta in translator.step(item):
                    if delta.index in active.cancelled:
                        continue
                    yield delta
        finally:
            if not translator.finished or not getattr(active.output, "finished", True):
                self._cancel(active)  # the client left, or we ended it (our stop ids) before TRT-LLM did
            self._active.pop(request.request_id, None)
            if translator.reports_cached and translator.responded:
                self._cache_hit_tokens += translator.cached_tokens
                self._cache_miss_tokens += len(request.prompt_token_ids) - translator.cached_tokens

    @staticmethod
    async def _pump(output: Any, queue: asyncio.Queue[Any], streaming: bool) -> None:
        """Read TRT-LLM's result to the end (even after we stop listening, so it is drained)."""
        try:
            if streaming:
                async for state in output:
                    queue.put_nowait(state)
            else:
                queue.put_nowait(await output)
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            queue.put_nowait(exc)
        queue.put_nowait(_DONE)

    def _refused(self, exc: RuntimeError) -> APIError:
        """An error from ``generate_async``: the executor's ``RequestError`` is about this request
        (a 400), or about its capacity (a 503); anything else is the engine failing."""
        text = str(exc)
        if self._llm is None or "shutting down" in text:
            return Overloaded("the TensorRT-LLM engine is shutting down")
        request_error = request_error_class(self.trtllm)
        if request_error is not None and isinstance(exc, request_error):
            if _BUSY.search(text):
                return Overloaded(f"TensorRT-LLM cannot take more requests now: {text}")
            return InvalidRequest(f"TensorRT-LLM refused the request: {text}")
        return EngineError(f"TensorRT-LLM failed to take the request: {text}")

    def _cancel(self, active: _Active) -> None:
        """Stop the request in TRT-LLM where the version can; otherwise it runs on to max_tokens."""
        if active.aborted:
            return
        active.aborted = True
        abort = getattr(active.output, "abort", None)
        if active.abortable and callable(abort):
            try:
                abort()
            except Exception:  # noqa: BLE001 - already finished or executor gone: nothing to stop
                pass
