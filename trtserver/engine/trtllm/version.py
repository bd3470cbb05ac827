"""Which TensorRT-LLM API generation is installed, found at run time (never at import time).

Four generations (what each supports: the mapping table in ``docs/deploy.md``):

* ``1.x-engine``  — 1.x serving a prebuilt TensorRT engine: ``tensorrt_llm._tensorrt_engine.LLM``.
* ``1.x-pytorch`` — 1.x serving the engine directory's HF checkpoint on TRT-LLM's PyTorch backend
  (``tensorrt_llm.LLM`` is the PyTorch class from 1.0 on).
* ``0.x``         — 0.12 … 0.21 with a prebuilt engine: ``tensorrt_llm.LLM`` (from ``tensorrt_llm.hlapi``
  through 0.14, ``tensorrt_llm.llmapi`` from 0.15).
* ``0.12-jetson`` — the ``v0.12.0-jetson`` branch (JetPack 6, Python 3.10): ``tensorrt_llm.hlapi``,
  no abort, no n/best_of, no per-request logits processors, no guided decoding, no LoRA in the LLM class.

Besides the version number, the names that moved are probed on the module itself (SamplingParams
fields, ``generate_async`` parameters, the LLM's ``LlmArgs`` fields), so a build in between is handled
by what it actually has.
Nothing here imports ``tensorrt_llm``; :func:`detect` receives the already imported module.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import platform
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any


class Generation(str, enum.Enum):
    V1_ENGINE = "1.x-engine"
    V1_PYTORCH = "1.x-pytorch"
    V0 = "0.x"
    JETSON = "0.12-jetson"

    @property
    def label(self) -> str:
        return {
            Generation.V1_ENGINE: "1.x, TensorRT engine",
            Generation.V1_PYTORCH: "1.x, PyTorch backend (HF checkpoint)",
            Generation.V0: "0.12–0.21, TensorRT engine",
            Generation.JETSON: "v0.12.0-jetson (Orin)",
        }[self]


class TrtllmVersionError(RuntimeError):
    """The installed TensorRT-LLM cannot serve this engine directory."""


_VERSION_RE = re.compile(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?")


def parse_release(version: str) -> tuple[int, int, int]:
    """``"1.2.0rc2"`` -> ``(1, 2, 0)``; ``"0.12.0-jetson"`` -> ``(0, 12, 0)``."""
    m = _VERSION_RE.match(version)
    if m is None:
        raise TrtllmVersionError(f"cannot parse the TensorRT-LLM version {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def is_jetson_build(version: str) -> bool:
    """The Jetson wheel is the 0.12 branch built for aarch64 (SM 8.7) on a Tegra system."""
    if "jetson" in version.lower():
        return True
    if parse_release(version)[:2] != (0, 12):
        return False
    return on_tegra()


def on_tegra() -> bool:
    return platform.machine() == "aarch64" and Path("/etc/nv_tegra_release").exists()


@dataclass(frozen=True, slots=True)
class BuildFacts:
    """What the prebuilt engine was built with (``<engine>/config.json`` ``build_config``)."""

    max_batch_size: int = 0
    max_input_len: int = 0
    max_seq_len: int = 0
    max_beam_width: int = 1
    gather_context_logits: bool = False
    gather_generation_logits: bool = False
    lora_plugin: bool = False
    vocab_size: int = 0
    lora_target_modules: tuple[str, ...] = ()
    lora_modules_to_hf: tuple[tuple[str, str], ...] = ()
    max_lora_rank: int = 0
    paged_context_fmha: bool | None = None
    """``plugin_config.use_paged_context_fmha``: KV-cache block reuse needs it; None where not recorded."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> BuildFacts:
        build = config.get("build_config") or {}
        pretrained = config.get("pretrained_config") or {}
        plugin = build.get("plugin_config") or {}
        lora = build.get("lora_config") or {}
        return cls(
            max_batch_size=int(build.get("max_batch_size") or 0),
            max_input_len=int(build.get("max_input_len") or 0),
            max_seq_len=int(build.get("max_seq_len") or 0),
            max_beam_width=int(build.get("max_beam_width") or 1),
            gather_context_logits=bool(build.get("gather_context_logits")
                                       or build.get("gather_all_token_logits")),
            gather_generation_logits=bool(build.get("gather_generation_logits")
                                          or build.get("gather_all_token_logits")),
            lora_plugin=plugin.get("lora_plugin") not in (None, False, "disable"),
            vocab_size=int(pretrained.get("vocab_size") or 0),
            lora_target_modules=tuple(str(m) for m in lora.get("lora_target_modules") or ()),
            lora_modules_to_hf=tuple((str(k), str(v)) for k, v in
                                     (lora.get("trtllm_modules_to_hf_modules") or {}).items()),
            max_lora_rank=int(lora.get("max_lora_rank") or 0),
            paged_context_fmha=(None if plugin.get("use_paged_context_fmha") is None
                                else plugin.get("use_paged_context_fmha") not in (False, "disable")),
        )


@dataclass(frozen=True, slots=True)
class ApiFeatures:
    """Everything the adapter decides from: the generation, probed names, build and start options."""

    version: str
    generation: Generation
    sampling_fields: frozenset[str]
    generate_params: frozenset[str]
    has_abort: bool
    has_guided_params: bool
    build: BuildFacts = BuildFacts()
    llm_args: frozenset[str] | None = None
    """The LLM constructor's keywords (its LlmArgs fields); None where they could not be read."""
    block_reuse_setting: bool = False
    """``LLM(kv_cache_config=KvCacheConfig(enable_block_reuse=...))`` can be passed."""
    # start-time choices (ours), filled in by the engine
    gather_generation_logits: bool = False
    guided_backend: str | None = None
    lora_enabled: bool = False
    pytorch_beam_width: int = 1
    """The PyTorch backend's LLM(max_beam_width=...), from the server option (1: no beam search)."""
    block_reuse: bool = False
    """KV-cache block reuse is asked for (the server's prefix_cache, where this version and engine allow)."""

    @property
    def release(self) -> tuple[int, int, int]:
        return parse_release(self.version)

    @property
    def trt_backend(self) -> bool:
        return self.generation is not Generation.V1_PYTORCH

    @property
    def max_beam_width(self) -> int:
        """Beams a request may ask for: the engine's build, or what the PyTorch LLM was started with."""
        return self.build.max_beam_width if self.trt_backend else self.pytorch_beam_width

    @property
    def multiple_sequences(self) -> bool:
        return "n" in self.sampling_fields and "best_of" in self.sampling_fields

    @property
    def dynamic_logits_processor(self) -> bool:
        """Per-request ``SamplingParams(logits_processor=…)`` (0.19+)."""
        return "logits_processor" in self.sampling_fields

    @property
    def logits_logprobs(self) -> bool:
        """Top-k logprobs computed by us from ``generation_logits`` (0.12–0.19: no ``logprobs: int``)."""
        return ("logprobs" not in self.sampling_fields and "return_generation_logits" in self.sampling_fields
                and self.build.gather_generation_logits)

    @property
    def priority(self) -> bool:
        return "priority" in self.generate_params

    @property
    def lora(self) -> bool:
        return "lora_request" in self.generate_params

    @property
    def reports_cached_tokens(self) -> bool:
        """``RequestOutput.cached_tokens`` holds the reused prompt tokens: 1.1+ on the PyTorch backend,
        whose ``LlmResult`` carries the count; the TensorRT backend's C++ ``Result`` has no such field,
        so there it stays 0."""
        return not self.trt_backend and self.release >= (1, 1, 0)

    @property
    def finish_reason(self) -> bool:
        return self.release >= (0, 14, 0)

    def llm_accepts(self, name: str) -> bool:
        """``LLM(name=...)`` is accepted; by release where the args class could not be read."""
        if self.llm_args is not None:
            return name in self.llm_args
        return self.release >= (1, 0, 0)

    def name(self, *candidates: str) -> str | None:
        """The first of ``candidates`` that this version's SamplingParams accepts (new name first)."""
        for candidate in candidates:
            if candidate in self.sampling_fields:
                return candidate
        return None

    def with_options(self, **changes: Any) -> ApiFeatures:
        return dataclasses.replace(self, **changes)


def llm_arg_fields(module: ModuleType, generation: Generation) -> frozenset[str] | None:
    """The LLM's keywords: pydantic ``model_fields`` of 1.x ``TrtLlmArgs`` / ``TorchLlmArgs``, or the
    fields of the ``@dataclass LlmArgs`` that 0.12–0.x build with ``cls(**kwargs)``."""
    root = module.__name__
    names = {Generation.V1_ENGINE: ["llmapi.llm_args:TrtLlmArgs"],
             Generation.V1_PYTORCH: ["llmapi.llm_args:TorchLlmArgs"]}.get(generation, [])
    names += ["llmapi.llm_args:LlmArgs", "llmapi.llm_utils:LlmArgs", "hlapi.llm_utils:LlmArgs"]
    for name in names:
        try:
            cls = _first_attr(module, [f"{root}.{name}"])
        except TrtllmVersionError:
            continue
        model_fields = getattr(cls, "model_fields", None)
        if isinstance(model_fields, dict):
            return frozenset(model_fields)
        if dataclasses.is_dataclass(cls):
            return frozenset(f.name for f in dataclasses.fields(cls))
    return None


def class_fields(cls: type) -> frozenset[str]:
    """Field names of a dataclass (private non-init ones like ``_return_log_probs`` included, to be
    set as attributes), or the constructor keywords of a plain class."""
    if dataclasses.is_dataclass(cls):
        return frozenset(f.name for f in dataclasses.fields(cls))
    params = inspect.signature(cls).parameters.values()
    return frozenset(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))


def _first_attr(module: ModuleType, paths: Iterable[str]) -> Any:
    """``"tensorrt_llm.hlapi:LLM"`` style lookups; the first that imports wins."""
    errors = []
    for path in paths:
        mod_name, _, attr = path.partition(":")
        try:
            mod = module if mod_name == module.__name__ else importlib.import_module(mod_name)
            return getattr(mod, attr)
        except (ImportError, AttributeError) as exc:
            errors.append(f"{path}: {exc}")
    raise TrtllmVersionError("none of these TensorRT-LLM names exist: " + "; ".join(errors))


def llm_class(module: ModuleType, generation: Generation) -> type:
    root = module.__name__
    paths = {
        Generation.V1_ENGINE: [f"{root}._tensorrt_engine:LLM"],
        Generation.V1_PYTORCH: [f"{root}:LLM"],
        Generation.V0: [f"{root}:LLM", f"{root}.hlapi:LLM"],
        Generation.JETSON: [f"{root}.hlapi:LLM", f"{root}:LLM"],
    }[generation]
    return _first_attr(module, paths)  # type: ignore[no-any-return]


def sampling_params_class(module: ModuleType) -> type:
    root = module.__name__
    return _first_attr(module, [f"{root}:SamplingParams", f"{root}.hlapi:SamplingParams"])  # type: ignore[no-any-return]


def guided_params_class(module: ModuleType) -> type | None:
    root = module.__name__
    try:
        return _first_attr(module, [f"{root}.sampling_params:GuidedDecodingParams",  # type: ignore[no-any-return]
                                    f"{root}.llmapi:GuidedDecodingParams"])
    except TrtllmVersionError:
        return None


def lora_request_class(module: ModuleType) -> type | None:
    root = module.__name__
    try:
        return _first_attr(module, [f"{root}.executor:LoRARequest",  # type: ignore[no-any-return]
                                    f"{root}.executor.request:LoRARequest"])
    except TrtllmVersionError:
        return None


def kv_cache_config_class(module: ModuleType) -> type | None:
    """``KvCacheConfig``: a pydantic model in 1.x ``llmapi.llm_args``, the C++ binding re-exported by
    ``llmapi`` (0.15+) or ``hlapi`` (0.12–0.14) before."""
    root = module.__name__
    try:
        return _first_attr(module, [f"{root}.llmapi:KvCacheConfig",  # type: ignore[no-any-return]
                                    f"{root}.hlapi:KvCacheConfig", f"{root}:KvCacheConfig"])
    except TrtllmVersionError:
        return None


def has_setting(cls: type, name: str) -> bool:
    """``cls(name=...)`` is accepted: a pydantic field, a dataclass field, a keyword of a plain class,
    or a property of a C++ binding (whose constructor signature cannot be read)."""
    model_fields = getattr(cls, "model_fields", None)
    if isinstance(model_fields, dict):
        return name in model_fields
    try:
        if name in class_fields(cls):
            return True
    except (TypeError, ValueError):
        pass
    return hasattr(cls, name)


def request_error_class(module: ModuleType) -> type[BaseException] | None:
    """``RequestError(RuntimeError)``: what the executor raises for one request it cannot take."""
    root = module.__name__
    try:
        return _first_attr(module, [f"{root}.executor:RequestError",  # type: ignore[no-any-return]
                                    f"{root}.executor.utils:RequestError"])
    except TrtllmVersionError:
        return None


def choose_generation(version: str, *, has_engine: bool) -> Generation:
    release = parse_release(version)
    if release < (0, 12, 0):
        raise TrtllmVersionError(f"TensorRT-LLM {version} is older than 0.12, the oldest supported")
    if release >= (1, 0, 0):
        return Generation.V1_ENGINE if has_engine else Generation.V1_PYTORCH
    if not has_engine:
        raise TrtllmVersionError(
            f"TensorRT-LLM {version} needs a prebuilt TensorRT engine (its PyTorch backend starts at 1.0); "
            "run `make engines` on this machine or serve with --engine torch")
    return Generation.JETSON if is_jetson_build(version) else Generation.V0


def detect(module: ModuleType, *, has_engine: bool, build: BuildFacts | None = None) -> ApiFeatures:
    """Probe the imported ``tensorrt_llm`` module."""
    version = str(getattr(module, "__version__", "") or "")
    if not version:
        raise TrtllmVersionError("tensorrt_llm has no __version__; is it a stub package from PyPI?")
    generation = choose_generation(version, has_engine=has_engine)
    llm_cls = llm_class(module, generation)
    sp_fields = class_fields(sampling_params_class(module))
    gen_async = getattr(llm_cls, "generate_async", None)
    if gen_async is None:
        raise TrtllmVersionError(f"{llm_cls!r} has no generate_async")
    gen_params = frozenset(inspect.signature(gen_async).parameters) - {"self"}
    release = parse_release(version)
    # RequestOutput.abort() is 0.19+ ("LLM API … Added abort request support"); the Jetson branch has none
    has_abort = release >= (0, 19, 0) and generation is not Generation.JETSON
    has_guided = "guided_decoding" in sp_fields and guided_params_class(module) is not None
    llm_args = llm_arg_fields(module, generation)
    kv_cls = kv_cache_config_class(module)
    reuse_setting = (kv_cls is not None and has_setting(kv_cls, "enable_block_reuse")
                     and (llm_args is None or "kv_cache_config" in llm_args))
    return ApiFeatures(version=version, generation=generation, sampling_fields=sp_fields,
                       generate_params=gen_params, has_abort=has_abort, has_guided_params=has_guided,
                       build=build or BuildFacts(), llm_args=llm_args, block_reuse_setting=reuse_setting)
