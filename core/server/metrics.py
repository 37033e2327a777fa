"""Prometheus metrics (``GET /metrics``), one private ``CollectorRegistry`` per app.

* counters: ``specfw_requests_total{endpoint,finish_reason}`` (one per engine request, i.e. per
  choice; finish_reason is stop | length | abort | error), ``specfw_request_errors_total{endpoint,
  status}`` (rejected HTTP requests), ``specfw_prompt_tokens_total``, ``specfw_generation_tokens_total``;
* histograms: ``specfw_time_to_first_token_seconds`` (engine arrival → first token),
  ``specfw_inter_token_latency_seconds`` (between tokens as delivered to the HTTP layer),
  ``specfw_e2e_request_latency_seconds``;
* engine state, read from the bridge's snapshot at scrape time: ``specfw_num_queue_reqs``,
  ``specfw_num_running_reqs``, ``specfw_kv_cache_usage`` (0..1), ``specfw_kv_cache_used_tokens`` (held by
  running requests), ``specfw_prefix_cache_tokens`` (held by the prefix cache), ``specfw_cache_hit_rate``,
  ``specfw_draft_kv_cache_used_tokens`` / ``_total_tokens`` (the drafter's own pool, eagle/eagle3/mtp/standalone),
  and for speculative decoding ``specfw_spec_verify_forwards_total``,
  ``specfw_spec_accepted_draft_tokens_total``, ``specfw_spec_proposed_draft_tokens_total``,
  ``specfw_spec_accept_length`` (tokens per verify forward, cumulative),
  ``specfw_spec_position_accept_rate{position}`` (per-depth acceptance), plus
  ``specfw_decode_steps_total``, ``specfw_retracted_requests_total``, ``specfw_engine_step_failures_total``.

Token counters and TTFT come from ``engine.stats.observers`` (called on the engine thread;
prometheus-client is thread-safe).
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

logger = logging.getLogger("specfw.server")

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _EngineCollector:
    def __init__(self, bridge):
        self.bridge = bridge

    def collect(self):
        s = self.bridge.snapshot

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            return c

        yield gauge("specfw_num_queue_reqs", "Requests waiting in the scheduler queue", s.waiting)
        yield gauge("specfw_num_running_reqs", "Requests in the running batch", s.running)
        yield gauge("specfw_kv_cache_usage", "Fraction of KV cache slots running requests hold", s.kv_usage)
        yield gauge("specfw_kv_cache_used_tokens", "KV cache slots running requests hold (the prefix cache's unshared entries excluded)", s.kv_used)
        yield gauge("specfw_prefix_cache_tokens", "KV slots the prefix cache holds", s.prefix_cache_tokens)
        yield gauge("specfw_cache_hit_rate", "Share of prefilled tokens the prefix cache supplied", s.cache_hit_rate)
        yield gauge("specfw_kv_cache_total_tokens", "KV cache slots", s.kv_total)
        yield gauge("specfw_draft_kv_cache_used_tokens", "Draft model KV cache slots in use", s.draft_kv_used)
        yield gauge("specfw_draft_kv_cache_total_tokens", "Draft model KV cache slots (0: no draft KV pool)", s.draft_kv_total)
        yield counter("specfw_spec_verify_forwards", "Speculative verify forwards", s.verify_forwards)
        yield counter("specfw_spec_accepted_draft_tokens", "Accepted draft tokens", s.accepted_draft_tokens)
        yield counter("specfw_spec_proposed_draft_tokens", "Proposed draft tokens", s.proposed_draft_tokens)
        yield gauge("specfw_spec_accept_length", "Tokens emitted per verify forward (cumulative mean)", s.accept_length)
        pos = GaugeMetricFamily(
            "specfw_spec_position_accept_rate", "Share of verify steps whose draft was accepted at least to this depth", labels=["position"]
        )
        for i, rate in enumerate(s.position_accept):
            pos.add_metric([str(i)], rate)
        yield pos
        yield counter("specfw_decode_steps", "Decode steps", s.decode_steps)
        yield counter("specfw_retracted_requests", "Requests retracted under KV pressure", s.num_retracted)
        yield counter("specfw_engine_step_failures", "Engine steps that raised", s.step_failures)


class ServerMetrics:
    def __init__(self, bridge, model_name: str):
        disable_created_metrics()  # no *_created series (process-wide setting of prometheus-client)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("specfw_requests", "Finished engine requests", ["endpoint", "finish_reason"], registry=r)
        self.errors = Counter("specfw_request_errors", "Rejected or failed HTTP requests", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("specfw_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("specfw_generation_tokens", "Generated tokens of finished requests", registry=r)
        self.ttft = Histogram("specfw_time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("specfw_inter_token_latency_seconds", "Inter-token latency", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("specfw_e2e_request_latency_seconds", "End-to-end request latency", buckets=E2E_BUCKETS, registry=r)
        r.register(_EngineCollector(bridge))
        self.model_name = model_name

    # ---- engine thread ------------------------------------------------------------------
    def observer(self, event: str, **kw) -> None:
        try:
            if event == "first_token":
                self.ttft.observe(kw["ttft"])
            elif event == "finish":
                req = kw["req"]
                self.prompt_tokens.inc(len(req.prompt_ids))
                self.generation_tokens.inc(len(req.output_ids))
        except Exception:  # never let metrics break a step
            logger.exception("metrics observer failed")

    # ---- event loop ---------------------------------------------------------------------
    def on_finish(self, endpoint: str, reason: str, seconds: float) -> None:
        self.requests.labels(endpoint, reason).inc()
        self.e2e.observe(seconds)

    def on_tokens(self, seconds: float, n: int) -> None:
        for _ in range(n):
            self.itl.observe(seconds / n)

    def on_error(self, endpoint: str, status: int) -> None:
        self.errors.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
