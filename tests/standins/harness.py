"""Helpers for the TensorRT-LLM tests: put one stand-in on sys.path (inside a test only), and make a
tiny engine directory (word-level tokenizer, manifest, optional TensorRT engine config).

Load with ``importlib`` by file path from the test modules; nothing here is installed.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from trtserver.engine.base import GenerationRequest, SamplingParams, SequenceOutput

STANDINS = Path(__file__).resolve().parent
GENERATIONS = ("v1", "v0", "jetson")
VOCAB = ["<s>", "</s>", *[f"w{i}" for i in range(2, 64)]]
EOS = 1


def clear_trtllm_modules() -> None:
    for name in list(sys.modules):
        if name == "tensorrt_llm" or name.startswith("tensorrt_llm.") or name == "standin_core":
            del sys.modules[name]


def use_standin(monkeypatch: pytest.MonkeyPatch, generation: str) -> ModuleType:
    """Import the stand-in ``tensorrt_llm`` of ``generation`` ("v1", "v0", "jetson")."""
    assert generation in GENERATIONS
    clear_trtllm_modules()
    monkeypatch.syspath_prepend(str(STANDINS))
    monkeypatch.syspath_prepend(str(STANDINS / generation))
    importlib.invalidate_caches()
    module = importlib.import_module("tensorrt_llm")
    assert Path(module.__file__ or "").is_relative_to(STANDINS), module.__file__
    return module


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``standin("v1")`` imports that stand-in; everything is undone after the test."""

    def load(generation: str) -> ModuleType:
        return use_standin(monkeypatch, generation)

    yield load
    clear_trtllm_modules()


def make_engine_dir(
    root: Path,
    *,
    trtllm_version: str | None = "1.2.0",
    context_length: int = 256,
    vocab_size: int = len(VOCAB),
    **build: Any,
) -> Path:
    """An engine directory: tokenizer files, HF config, manifest; with ``trtllm_version`` also a
    TensorRT-LLM engine under ``trtllm/`` (config.json with pretrained_config + build_config).
    ``vocab_size`` is the model's (padded, as in many HF configs) vocabulary; the tokenizer has 64."""
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, t in enumerate(VOCAB[:2])
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {t: i for i, t in enumerate(VOCAB)}, "unk_token": "<s>"},
    }
    (root / "tokenizer.json").write_text(json.dumps(tokenizer))
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (root / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": vocab_size,
                "num_hidden_layers": 2,
                "eos_token_id": EOS,
            }
        )
    )
    manifest: dict[str, Any] = {
        "format_version": 1,
        "served_model_name": "tiny",
        "dtype": "float16",
        "context_length": context_length,
        "source": {"kind": "hf-checkpoint", "location": str(root), "sha256": "0" * 64},
        "weights_sha256": "1" * 64,
        "created_by": "test",
    }
    if trtllm_version is not None:
        engine = root / "trtllm"
        engine.mkdir(exist_ok=True)
        build_config = {
            "max_batch_size": 8,
            "max_input_len": 128,
            "max_seq_len": context_length,
            "max_beam_width": 1,
            "gather_context_logits": False,
            "plugin_config": {},
        }
        build_config.update(build)
        (engine / "config.json").write_text(
            json.dumps(
                {
                    "version": trtllm_version,
                    "build_config": build_config,
                    "pretrained_config": {
                        "architecture": "LlamaForCausalLM",
                        "dtype": "float16",
                        "vocab_size": vocab_size,
                        "num_hidden_layers": 2,
                    },
                }
            )
        )
        (engine / "rank0.engine").write_bytes(b"")
        manifest["trtllm"] = {"version": trtllm_version, "engine_dir": "trtllm", "build_args": build_config}
    (root / "trtserver.json").write_text(json.dumps(manifest))
    return root


# --- a TrtllmEngine over a stand-in, and reading what it yields -------------------------------------

VERSIONS = {"v1": "1.2.0", "v0": "0.16.0", "jetson": "0.12.0"}


def make_engine(
    standin: Any,
    tmp_path: Path,
    generation: str,
    *,
    engine: bool = True,
    jetson: bool = False,
    monkeypatch: pytest.MonkeyPatch | None = None,
    **config: Any,
) -> Any:
    standin(generation)
    if jetson:
        assert monkeypatch is not None
        monkeypatch.setattr("trtserver.engine.trtllm.version.on_tegra", lambda: True)
    build = config.pop("build", {})
    root = make_engine_dir(
        tmp_path / "e", trtllm_version=VERSIONS[generation] if engine else None, **build
    )
    from trtserver.config import ServerConfig
    from trtserver.engine.trtllm import TrtllmEngine

    return TrtllmEngine(ServerConfig(engine_dir=str(root), **config))


def request(
    rid: str = "r", *, n: int = 1, prompt: list[int] | None = None, **sampling: Any
) -> GenerationRequest:
    extra = {
        k: sampling.pop(k) for k in ("priority", "adapter", "guided", "logits_processors") if k in sampling
    }
    sampling.setdefault("temperature", 0.8)
    return GenerationRequest(rid, prompt or [2, 3, 4], SamplingParams(**sampling), n=n, **extra)


async def collect(engine: Any, req: GenerationRequest) -> list[SequenceOutput]:
    await engine.start()
    return [d async for d in engine.generate(req)]


def tokens(deltas: list[SequenceOutput], index: int = 0) -> list[int]:
    return [t for d in deltas if d.index == index for t in d.token_ids]


def finish(deltas: list[SequenceOutput], index: int = 0) -> SequenceOutput:
    done = [d for d in deltas if d.index == index and d.finish_reason is not None]
    assert len(done) == 1, deltas
    return done[0]
