"""Tests as any plugin author writes them: the ``trtserver_client_factory`` fixture (installed with
trtserver as a pytest plugin) serves the real default model with the plugin loaded."""

from __future__ import annotations

import pytest
import torch
import trtserver_example_banned_words as plugin

PROMPT = "The capital of France is"
SMALL = {"max_batch_size": 4, "max_model_len": 512}  # a small KV cache starts faster


# trtserver's own pytest config runs async fixtures on one session-wide loop; share it.
# (In a project with pytest-asyncio's default loop scope this mark is not needed.)
@pytest.mark.asyncio(loop_scope="session")
async def test_banned_word_in_prompt_is_400(trtserver_client_factory, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("TRTSERVER_BANNED_WORDS", "dragons, lava")
    client = await trtserver_client_factory(plugins=[plugin], plugin_allowlist=[], **SMALL)
    response = await client.post("/v1/completions", json={"prompt": ["ok", "Tell me about Dragons"], "max_tokens": 2})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["param"] == "prompt" and "Dragons" in error["message"]
    response = await client.post("/v1/completions", json={"prompt": "Tell me about dragonflies", "max_tokens": 2})
    assert response.status == 200

    # and the model cannot say it: greedy output without, then with the ban
    monkeypatch.delenv("TRTSERVER_BANNED_WORDS")
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    free = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]["text"]
    assert "Paris" in free
    monkeypatch.setenv("TRTSERVER_BANNED_WORDS", "paris")
    banned = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]["text"]
    assert "Paris" not in banned and "paris" not in banned.lower()


def test_processor_blocks_only_completing_tokens() -> None:
    ban = plugin.BanSequences(((5,), (1, 2, 3)))
    logits = torch.zeros(8)
    ban([9, 1, 2], logits)
    assert logits[5] == float("-inf") and logits[3] == float("-inf") and logits[2] == 0
    logits = torch.zeros(8)
    ban([1, 9], logits)
    assert logits[3] == 0 and logits[5] == float("-inf")
