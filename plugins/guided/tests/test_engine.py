"""Guided generation with the real SmolLM2-135M on the PyTorch engine (CPU), every backend."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from trtserver.engine.base import GenerationRequest, GuidedDecoder, SamplingParams
from trtserver.guided import GuideContext, GuideSpec

from trtserver_guided.plugin import guided_decoder

BACKENDS = ("xgrammar", "llguidance", "outlines", "lm-format-enforcer")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def engine(engine_dir: Path) -> Iterator[object]:
    if not (engine_dir / "model.safetensors").exists():
        pytest.skip("no model weights")
    from trtserver.engine.torch.engine import TorchEngine

    eng = TorchEngine.from_dir(engine_dir, dtype="float32", device="cpu", max_batch_size=4, max_model_len=256,
                               seed=0)
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.shutdown())


_ids = iter(range(10**9))


def generate(engine: object, prompt: str, guided: GuidedDecoder, max_tokens: int) -> tuple[str, str | None]:
    async def run() -> tuple[str, str | None]:
        ids = engine.tokenizer.encode(chat(prompt))  # type: ignore[attr-defined]
        request = GenerationRequest(f"g{next(_ids)}", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                    guided=guided)
        tokens: list[int] = []
        finish = None
        async for delta in engine.generate(request):  # type: ignore[attr-defined]
            tokens.extend(delta.token_ids)
            finish = delta.finish_reason or finish
        return engine.tokenizer.decode(tokens), finish  # type: ignore[attr-defined]

    return asyncio.run(run())


def ctx_of(engine: object) -> GuideContext:
    info = engine.info  # type: ignore[attr-defined]
    return GuideContext(tokenizer=engine.tokenizer, vocab_size=info.vocab_size,  # type: ignore[attr-defined]
                        eos_token_ids=info.eos_token_ids)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_json_regex_choice(backend: str, engine: object) -> None:
    ctx = ctx_of(engine)
    text, finish = generate(engine, "Give me a person as JSON with a name and an age.",
                            guided_decoder(GuideSpec("json", json.dumps(SCHEMA)), backend, ctx), 40)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert finish == "stop", text
    text, finish = generate(engine, "Write a phone number like 555-1234.",
                            guided_decoder(GuideSpec("regex", r"\d{3}-\d{4}"), backend, ctx), 16)
    assert re.fullmatch(r"\d{3}-\d{4}", text) and finish == "stop", (text, finish)
    choices = ("yes", "no")
    text, finish = generate(engine, "Is the sky green? Answer yes or no.",
                            guided_decoder(GuideSpec("choice", choices), backend, ctx), 8)
    assert text in choices and finish == "stop", (text, finish)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ("xgrammar", "llguidance"))
def test_grammar(backend: str, engine: object) -> None:
    grammar = 'root ::= num " " op " " num\nnum ::= [1-9] [0-9]?\nop ::= "+" | "-" | "*"'
    text, finish = generate(engine, "Write a small arithmetic expression.",
                            guided_decoder(GuideSpec("grammar", grammar), backend, ctx_of(engine)), 16)
    assert re.fullmatch(r"[1-9][0-9]? [+*-] [1-9][0-9]?", text) and finish == "stop", (text, finish)
