"""Tests as any plugin author writes them: the ``trtserver_scripted_client_factory`` fixture (installed
with trtserver as a pytest plugin) serves the real app on a scripted engine, with the plugin loaded.
The test writes what the model says, so the plugin's effect on it is plain to see. The plugin's
``[plugins.banned_words]`` table is passed as the ``plugin_settings`` setting."""

from __future__ import annotations

from typing import Any

import pytest
import trtserver_example_banned_words as plugin

from trtserver.plugins import PluginConfigError
from trtserver.scripted_engine import reply

ANSWER = " The capital of France is Paris, and paris is lovely."


def ban(*words: str) -> dict[str, Any]:
    """The settings that load the plugin alone with these banned words."""
    return {"plugins": [plugin], "plugin_allowlist": [], "plugin_settings": {"banned_words": {"words": list(words)}}}


async def text_of(client: Any, **body: Any) -> str:
    response = await client.post("/v1/completions", json={"prompt": "Tell me", "max_tokens": 32, **body})
    assert response.status == 200
    return str((await response.json())["choices"][0]["text"])


async def test_banned_word_in_prompt_is_400(trtserver_scripted_client_factory: Any) -> None:
    client = await trtserver_scripted_client_factory(**ban("dragons", " lava "))
    response = await client.post("/v1/completions", json={"prompt": ["ok", "Tell me about Dragons"], "max_tokens": 2})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["param"] == "prompt" and "Dragons" in error["message"]
    response = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Is lava hot?"}], "max_tokens": 2})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["param"] == "messages" and "lava" in error["message"]
    response = await client.post("/v1/completions", json={"prompt": "Tell me about dragonflies", "max_tokens": 2})
    assert response.status == 200


async def test_the_model_cannot_say_a_banned_word(trtserver_scripted_client_factory: Any) -> None:
    plain = await trtserver_scripted_client_factory(plugins=[plugin], plugin_allowlist=[], script=reply(ANSWER))
    assert await text_of(plain) == ANSWER  # with no words configured, the plugin does nothing
    client = await trtserver_scripted_client_factory(**ban("paris"), script=reply(ANSWER))
    banned = await text_of(client)
    assert "paris" not in banned.lower()
    assert banned.startswith(" The capital of France is") and banned.endswith(" is lovely.")  # the rest is said
    streamed = await client.post("/v1/completions", json={"prompt": "Tell me", "max_tokens": 32, "stream": True})
    assert "paris" not in (await streamed.text()).lower()


@pytest.mark.parametrize("table", [{"words": "dragons"}, {"word": ["dragons"]}])
async def test_a_bad_table_stops_start_up(trtserver_scripted_client_factory: Any, table: dict[str, Any]) -> None:
    named = r"plugin 'banned_words': invalid settings in \[plugins\.banned_words\]"
    with pytest.raises(PluginConfigError, match=named):
        await trtserver_scripted_client_factory(plugins=[plugin], plugin_allowlist=[],
                                                plugin_settings={"banned_words": table})


def test_processor_blocks_only_completing_tokens() -> None:
    ban = plugin.BanSequences(((5,), (1, 2, 3)))
    logits = [0.0] * 8  # the engine hands a 1-D tensor; indexing is all this processor needs
    ban([9, 1, 2], logits)
    assert logits[5] == float("-inf") and logits[3] == float("-inf") and logits[2] == 0
    logits = [0.0] * 8
    ban([1, 9], logits)
    assert logits[3] == 0 and logits[5] == float("-inf")
