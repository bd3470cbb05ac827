"""Operating it: API keys, service tiers and quotas, metrics, OpenAPI, queue limits, health."""

from __future__ import annotations

from typing import Any

import pytest

from trtserver.config import TierLimits

BODY = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}


@pytest.fixture
async def ops_client(trtserver_client_factory: Any) -> Any:
    return await trtserver_client_factory(
        api_keys=["k-default"], no_limit_api_keys=["k-vip"],
        quotas={"default": TierLimits(requests_per_minute=2), "big": TierLimits(requests_per_minute=100)},
        max_flex_waiting=0, metrics_exemplars="request_id_and_user")


def auth(key: str = "k-default") -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_api_keys(ops_client: Any) -> None:
    missing = await ops_client.post("/v1/completions", json=BODY)
    assert missing.status == 401
    assert (await missing.json())["error"]["type"] == "authentication_error"
    wrong = await ops_client.post("/v1/completions", json=BODY, headers=auth("nope"))
    assert wrong.status == 401
    assert (await ops_client.get("/health")).status == 200  # health and metrics stay open
    assert (await ops_client.get("/v1/models", headers=auth())).status == 200


async def test_default_tier_quota_gives_429_with_headers(ops_client: Any) -> None:
    url = "/v1/completions?ai_project_id=small"
    first = await ops_client.post(url, json={**BODY, "service_tier": "default"}, headers=auth())
    assert first.status == 200
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert (await first.json())["service_tier"] == "default"
    assert (await ops_client.post(url, json={**BODY, "service_tier": "default"}, headers=auth())).status == 200
    third = await ops_client.post(url, json={**BODY, "service_tier": "default"}, headers=auth())
    assert third.status == 429
    assert int(third.headers["Retry-After"]) >= 1
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    assert (await third.json())["error"]["type"] == "rate_limit_error"
    # auto: still served, marked over-limit
    auto = await ops_client.post(url, json={**BODY, "service_tier": "auto"}, headers=auth())
    assert auto.status == 200 and (await auto.json())["service_tier"] == "over-limit"
    # another project has its own budget
    other = await ops_client.post("/v1/completions?ai_project_id=big", json=BODY, headers=auth())
    assert other.status == 200 and (await other.json())["service_tier"] == "auto"


async def test_tier_rules(ops_client: Any) -> None:
    over = await ops_client.post("/v1/completions", json={**BODY, "service_tier": "over-limit"}, headers=auth())
    assert over.status == 400 and (await over.json())["error"]["param"] == "service_tier"
    denied = await ops_client.post("/v1/completions", json={**BODY, "service_tier": "no-limit"}, headers=auth())
    assert denied.status == 403
    vip = await ops_client.post("/v1/completions", json={**BODY, "service_tier": "no-limit"}, headers=auth("k-vip"))
    assert vip.status == 200 and (await vip.json())["service_tier"] == "no-limit"
    flex = await ops_client.post("/v1/completions", json={**BODY, "service_tier": "flex"}, headers=auth())
    assert flex.status == 429  # max_flex_waiting=0: its queue is always full here


async def test_metrics_and_openapi(ops_client: Any) -> None:
    await ops_client.post("/v1/completions?ai_project_id=big", json=BODY, headers=auth())
    text = await (await ops_client.get("/metrics")).text()
    for name in ("trtserver_requests_total", "trtserver_completion_tokens_total", "trtserver_queue_depth",
                 "trtserver_running_sequences", "trtserver_kv_slots_used", "trtserver_time_to_first_token_seconds",
                 "trtserver_inter_token_latency_seconds"):
        assert name in text
    assert 'status="200"' in text
    await ops_client.post("/v1/completions?ai_project_id=big", json={**BODY, "user": "alice"},
                          headers={**auth(), "X-Request-Id": "req-123"})
    scrape = await ops_client.get("/metrics", headers={"Accept": "application/openmetrics-text"})
    assert scrape.headers["Content-Type"].startswith("application/openmetrics-text")
    assert '{request_id="req-123",user="alice"}' in await scrape.text()  # an exemplar, not a label
    spec = await (await ops_client.get("/openapi.json", headers=auth())).json()
    assert spec["openapi"].startswith("3.")
    schema = spec["components"]["schemas"]["CompletionRequest"]
    assert "guided_json" in schema["properties"] and "prompt" in schema["required"]


async def test_waiting_queue_bound(trtserver_client_factory: Any) -> None:
    client = await trtserver_client_factory(max_waiting=1)
    # nothing waits while idle, so a single request is served
    assert (await client.post("/v1/completions", json=BODY)).status == 200


async def test_request_timeout_and_prompt_limit(trtserver_client_factory: Any) -> None:
    client = await trtserver_client_factory(request_timeout_s=0.05, max_prompt_tokens=8)
    slow = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 400, "ignore_eos": True})
    assert slow.status == 504
    assert (await slow.json())["error"]["type"] == "timeout_error"
    long_prompt = await client.post("/v1/completions", json={"prompt": "word " * 20, "max_tokens": 1})
    assert long_prompt.status == 400
    assert (await long_prompt.json())["error"]["param"] == "prompt"
    # the server is still fine afterwards, and the timed-out request freed its slot
    stats = await (await client.get("/metrics")).text()
    assert "trtserver_requests_total" in stats


async def test_streamed_request_timeout_ends_with_error_event(trtserver_client_factory: Any) -> None:
    client = await trtserver_client_factory(request_timeout_s=1.0)
    response = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1000, "ignore_eos": True,
                                                           "stream": True})
    assert response.status == 200
    events = [line for line in (await response.text()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert '"timeout_error"' in events[-2]
    assert len(events) > 3  # some tokens arrived before the deadline
