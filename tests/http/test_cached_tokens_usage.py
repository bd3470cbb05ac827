"""Prompt tokens served from the prefix cache, as OpenAI reports them: ``usage.prompt_tokens_details.
cached_tokens`` in completions and chat, streamed and not, and the hit/miss counters in ``/metrics``."""

from __future__ import annotations

import re
import uuid

import httpx
from openai import OpenAI

SYSTEM = ("You are a careful assistant for a lighthouse museum. Answer in one short sentence, name the keeper "
          "when it helps, and never invent dates. The museum opens at nine and closes at five.")


def counter(http: httpx.Client, name: str) -> float:
    text = http.get("/metrics").text
    match = re.search(rf"^{name}_total (\S+)$", text, re.M)
    assert match, f"{name}_total not in /metrics"
    return float(match.group(1))


def test_chat_reports_the_cached_system_prompt(client: OpenAI, http: httpx.Client) -> None:
    system = f"{SYSTEM} Visitor {uuid.uuid4().hex[:8]}."  # a prefix no earlier test has sent
    hits = counter(http, "trtserver_prefix_cache_hit_tokens")
    first = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=5, temperature=0,
                                           messages=[{"role": "system", "content": system},
                                                     {"role": "user", "content": "When do you open?"}])
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens < 20  # at most the chat template's opening
    second = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=5, temperature=0,
                                            messages=[{"role": "system", "content": system},
                                                      {"role": "user", "content": "Who kept the light?"}])
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 40 < cached < second.usage.prompt_tokens  # the system prompt, not the new question
    assert counter(http, "trtserver_prefix_cache_hit_tokens") - hits >= cached


def test_completions_report_cached_tokens_streamed_and_not(client: OpenAI, http: httpx.Client) -> None:
    prompt = f"{SYSTEM} Ticket {uuid.uuid4().hex[:8]}: the visitor asked"
    misses = counter(http, "trtserver_prefix_cache_miss_tokens")
    first = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=4, temperature=0,
                                      logprobs=1)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert counter(http, "trtserver_prefix_cache_miss_tokens") - misses >= first.usage.prompt_tokens - 20
    again = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=4, temperature=0,
                                      logprobs=1)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    # the cached K/V are the prompt's: the first token scores as it did (a near tie may still pick another,
    # since the shorter prefill rounds apart)
    assert first.choices[0].logprobs is not None and again.choices[0].logprobs is not None
    was, now = first.choices[0].logprobs.token_logprobs, again.choices[0].logprobs.token_logprobs
    assert was is not None and now is not None and abs(was[0] - now[0]) < 0.1
    body = {"model": "SmolLM2-135M-Instruct", "prompt": [prompt, prompt], "max_tokens": 4, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    usage = httpx.Response(200, content=lines[-1][6:]).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 2 * (again.usage.prompt_tokens - 1)
