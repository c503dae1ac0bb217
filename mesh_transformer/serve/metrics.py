"""Prometheus metrics of one server (`GET /metrics`), with their own registry so that several servers
(tests) can live in one process. Names follow vLLM's where there is one, prefixed `mesh_transformer_`."""
from __future__ import annotations

from typing import Callable, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "mesh_transformer_"
CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds. TTFT spans a prefill on a CPU (ms) to a queue wait behind full batches (minutes).
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.queue_depth = Gauge(PREFIX + "queue_depth", "Sequences waiting for a row", registry=r)
        self.running_rows = Gauge(PREFIX + "running_rows", "Rows of the batch decoding a sequence", registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated", registry=r)
        self.decode_row_passes = Counter(
            PREFIX + "decode_row_passes", "Passes of the model over a running row while it decodes: a token each "
            "without --speculate; with it, generation_tokens / decode_row_passes - 1 is the drafted tokens a pass "
            "kept (each row's first token comes from its prefill, not a pass)", registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first generated token (queue + prefill)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Seconds per generated token after the first: the time between two deliveries to a "
                             "sequence divided by the tokens delivered (decode runs in chunks of --chunk steps)",
                             buckets=ITL_BUCKETS, registry=r)
        self.prefix_queries = Counter(PREFIX + "prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache (0 without one)", registry=r)
        self.prefix_hits = Counter(PREFIX + "prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache (their keys and values were read, "
                                   "not computed)", registry=r)
        self.prefix_hit_rate = Gauge(PREFIX + "prefix_cache_hit_rate",
                                     "prefix_cache_hits / prefix_cache_queries", registry=r)
        self.prefix_hit_rate.set_function(self._hit_rate)
        self._queried = self._found = 0

    def watch(self, queued: Callable[[], int], running: Callable[[], int]) -> None:
        """Read the queue depth and running rows from these functions at each scrape."""
        self.queue_depth.set_function(queued)
        self.running_rows.set_function(running)

    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def admitted(self, prompt_lengths: list[int], prefix_hits: Optional[int]) -> None:
        """Prompts prefilled; `prefix_hits`: their tokens found in the prefix cache (None: there is none)."""
        tokens = sum(prompt_lengths)
        self.prompt_tokens.inc(tokens)
        if prefix_hits is not None:
            self.prefix_queries.inc(tokens)
            self.prefix_hits.inc(prefix_hits)
            self._queried += tokens
            self._found += prefix_hits

    def generated(self, tokens: int, first: Optional[float], spacing: float, spaced: int) -> None:
        """`tokens` new tokens of one sequence; `first`: seconds to its first token if among them;
        `spaced` of them came `spacing` seconds apart."""
        self.generation_tokens.inc(tokens)
        if first is not None:
            self.ttft.observe(first)
        for _ in range(spaced):
            self.itl.observe(spacing)

    def _hit_rate(self) -> float:
        return self._found / self._queried if self._queried else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)
