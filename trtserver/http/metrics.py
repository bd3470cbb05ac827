"""Prometheus metrics, one registry per app (no module globals), served at ``/metrics``."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector

from trtserver.engine.base import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class _EngineCollector(Collector):
    """Engine gauges read at scrape time, so the serving path never updates them."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            return
        yield GaugeMetricFamily("trtserver_queue_depth", "Requests waiting for a slot", value=stats.waiting)
        yield GaugeMetricFamily("trtserver_running_sequences", "Sequences in the running batch", value=stats.running)
        yield GaugeMetricFamily("trtserver_kv_slots_used", "KV-cache slots in use", value=stats.slots_used)
        yield GaugeMetricFamily("trtserver_kv_slots_total", "KV-cache slots", value=stats.slots_total)
        yield CounterMetricFamily("trtserver_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                  value=stats.prefix_cache_hit_tokens)
        yield CounterMetricFamily("trtserver_prefix_cache_miss_tokens",
                                  "Prompt tokens computed while the prefix cache was on",
                                  value=stats.prefix_cache_miss_tokens)


class Metrics:
    def __init__(self, engine_stats: Callable[[], EngineStats | None], exemplars: str = "none") -> None:
        self.exemplars = exemplars  # none | request_id | request_id_and_user (ServerConfig.metrics_exemplars)
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("trtserver_requests", "Completed HTTP requests to the generation endpoints",
                                ["status", "tier", "endpoint"], registry=self.registry)
        self.prompt_tokens = Counter("trtserver_prompt_tokens", "Prompt tokens processed", registry=self.registry)
        self.completion_tokens = Counter("trtserver_completion_tokens", "Tokens generated", registry=self.registry)
        self.time_to_first_token = Histogram("trtserver_time_to_first_token_seconds", "Time to the first token",
                                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram("trtserver_inter_token_latency_seconds",
                                             "Mean time between tokens of a request", buckets=TOKEN_BUCKETS,
                                             registry=self.registry)
        self.request_latency = Histogram("trtserver_request_latency_seconds", "Whole request time",
                                         buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(engine_stats))

    def observe_request(self, *, status: int, tier: str | None, prompt_tokens: int, completion_tokens: int,
                        ttft_s: float | None, total_s: float, request_id: str = "", user: str | None = None,
                        endpoint: str = "completions") -> None:
        """Once per request: token-level timing is summarised by the caller, never observed per token.

        Where the operator asks for them (``metrics_exemplars``), the request id and the client's
        ``user`` ride on the latency histogram as an OpenMetrics exemplar (shown to scrapers that ask
        for OpenMetrics), not as labels, which would grow without bound; by default they carry
        nothing that identifies a client."""
        self.requests.labels(status=str(status), tier=tier or "none", endpoint=endpoint).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        exemplar: dict[str, str] | None = None
        if self.exemplars != "none":  # exemplar label sets are limited to 128 characters in all
            exemplar = {"request_id": request_id[:64]}
            if self.exemplars == "request_id_and_user":
                exemplar["user"] = (user or "")[:48]
        self.request_latency.observe(total_s, exemplar=exemplar)
        if ttft_s is not None:
            self.time_to_first_token.observe(ttft_s)
            if completion_tokens > 1:
                self.inter_token_latency.observe((total_s - ttft_s) / (completion_tokens - 1))

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition and its content type: OpenMetrics (with exemplars) when the scraper asks."""
        if "application/openmetrics-text" in accept:
            return openmetrics.generate_latest(self.registry), openmetrics.CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
