"""The real model's chat template: rendered as transformers renders it, text and token ids
(tests/unit/test_chat_template.py has the rest, on the scripted engine's ChatML template)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trtserver.chat_template import ChatTemplate, read_engine_dir_template, resolve_chat_template, template_token_ids
from trtserver.config import ServerConfig
from trtserver.plugins import new_plugin_manager
from trtserver.tokenizer import Tokenizer

SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    [{"role": "user", "content": "Écris «ça» en 世界 <b>html</b>"}, {"role": "assistant", "content": " spaced "}],
]


@pytest.fixture(scope="module")
def tokenizer(smol_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smol_dir)


@pytest.fixture(scope="module")
def smol(smol_dir: Path, tokenizer: Tokenizer) -> ChatTemplate:
    found = read_engine_dir_template(smol_dir)
    assert found is not None
    return ChatTemplate.for_tokenizer(found[0], tokenizer)


@pytest.fixture(scope="module")
def hf_tokenizer(smol_dir: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(smol_dir))


def test_smollm2_template_renders_each_role(smol: ChatTemplate) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}]
    assert smol.render(messages) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                     "<|im_start|>assistant\nHello!<|im_end|>\n")
    assert smol.render(messages[1:2], add_generation_prompt=True) == (
        SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("options", [{"add_generation_prompt": True}, {"add_generation_prompt": False},
                                     {"continue_final_message": True}])
def test_smollm2_matches_transformers_text_and_ids(smol: ChatTemplate, tokenizer: Tokenizer, hf_tokenizer: Any,
                                                   messages: list[dict[str, Any]], options: dict[str, Any]) -> None:
    text = smol.render(messages, **options)
    assert text == hf_tokenizer.apply_chat_template(messages, tokenize=False, **options)
    expected_ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **options)
    assert template_token_ids(text, tokenizer) == list(expected_ids)


def test_continue_final_message_cuts_after_the_content(smol: ChatTemplate) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    assert smol.render(messages, continue_final_message=True) == (
        SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe answer is")


def test_special_tokens_become_single_ids(smol: ChatTemplate, tokenizer: Tokenizer) -> None:
    ids = template_token_ids(smol.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True), tokenizer)
    start, end = tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|im_end|>")
    assert start is not None and end is not None
    assert ids[0] == start and ids.count(start) == 3 and ids.count(end) == 2
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_the_default_model_has_a_template_and_its_special_tokens(smol_dir: Path, tokenizer: Tokenizer) -> None:
    template = resolve_chat_template(ServerConfig(engine_dir=str(smol_dir)), new_plugin_manager(), tokenizer)
    assert template is not None and "<|im_start|>" in template.source
    assert tokenizer.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                        "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}
