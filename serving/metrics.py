"""Engine metrics in the Prometheus data model, through the official `prometheus_client`.

Every `EngineMetrics` owns its own `CollectorRegistry` instead of the client's
process-wide default registry: tests and benchmarks build several engines (and
servers) in one process, and series registered twice in one registry raise.
The engine updates the series from its loop thread; the client's metrics are
thread-safe, so the HTTP thread reads them (`exposition`, `value`) without a
lock of ours. `exposition(accept)` negotiates the format as a Prometheus
server expects (`prometheus_client.exposition.choose_encoder`: the OpenMetrics
text format when the scraper's Accept header asks for it, else the text format
0.0.4; https://prometheus.io/docs/instrumenting/exposition_formats/).

Series (`EngineMetrics`):
  horizon_requests_total{status}            finished requests by finish reason, plus
                                            'rejected' (bad request) and 'overloaded'
  horizon_prompt_tokens_total               prompt tokens of admitted requests
  horizon_generation_tokens_total           generated tokens
  horizon_time_to_first_token_seconds       submit -> first generated token (histogram)
  horizon_inter_token_latency_seconds       between consecutive tokens of a request (histogram)
  horizon_queue_length                      requests waiting for a slot
  horizon_slots_used / horizon_slots_total  batch slots holding a request / all slots
  horizon_context_tokens_used               tokens held in the decode states of busy slots
  horizon_context_tokens_capacity           slots * max_context
  horizon_prefix_cache_reused_tokens_total  prompt tokens loaded from the prefix cache instead
                                            of prefilled (serving/prefix_cache.py)
  horizon_prefix_cache_hit_rate             reused / prompt tokens since start (the per-window
                                            rate: rate(reused_total) / rate(prompt_tokens_total))
  horizon_prefix_cache_blocks               cached blocks
  horizon_prefix_cache_evictions_total      blocks evicted to make room
  horizon_prefix_cache_bytes / _capacity_bytes  memory held by the blocks / the budget

The client also writes a `*_created` timestamp per counter and histogram
(part of the OpenMetrics model). The prefix-cache series stay 0 when the cache is off
(config.serving.prefix_cache_mb=0).
"""

from __future__ import annotations

from typing import Any

import prometheus_client
from prometheus_client.exposition import choose_encoder

# Latency buckets (seconds): 1 ms .. 60 s, roughly x2.5 apart.
LATENCY_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                                      2.5, 5.0, 10.0, 30.0, 60.0)


def _sample(metric: prometheus_client.metrics.MetricWrapperBase, suffix: str,
            labels: dict[str, str]) -> float:
  """The current value of `metric`'s sample `<name><suffix>{labels}` (0 before the first update)."""
  for family in metric.collect():
    for sample in family.samples:
      if sample.name == family.name + suffix and sample.labels == labels:
        return sample.value
  return 0.0


class Counter(prometheus_client.Counter):
  """A Prometheus counter whose value can be read back (tests, waits on cancellation)."""

  def value(self, **labels: str) -> float:
    """The count of the series with these label values (0 if never incremented)."""
    return _sample(self, "_total", labels)


class Gauge(prometheus_client.Gauge):
  """A Prometheus gauge whose value can be read back."""

  def value(self) -> float:
    return _sample(self, "", {})


class EngineMetrics:
  """The engine's series (see the module docstring) in a registry of their own.

  Args:
    slots: the engine's batch slots (horizon_slots_total).
    max_context: tokens per slot (horizon_context_tokens_capacity = slots * max_context).
  """

  def __init__(self, slots: int, max_context: int):
    self.registry = prometheus_client.CollectorRegistry()
    reg = self.registry
    self.requests = Counter("horizon_requests_total",
                            "Requests by outcome (finish reason, rejected, overloaded).", ["status"],
                            registry=reg)
    self.prompt_tokens = Counter("horizon_prompt_tokens_total", "Prompt tokens of admitted requests.",
                                 registry=reg)
    self.generation_tokens = Counter("horizon_generation_tokens_total", "Generated tokens.", registry=reg)
    self.ttft = prometheus_client.Histogram(
        "horizon_time_to_first_token_seconds", "Seconds from submission to the first generated token.",
        buckets=LATENCY_BUCKETS, registry=reg)
    self.itl = prometheus_client.Histogram(
        "horizon_inter_token_latency_seconds", "Seconds between consecutive generated tokens of a request.",
        buckets=LATENCY_BUCKETS, registry=reg)
    self.queue_length = Gauge("horizon_queue_length", "Requests waiting for a free slot.", registry=reg)
    self.slots_used = Gauge("horizon_slots_used", "Batch slots holding a request.", registry=reg)
    self.slots_total = Gauge("horizon_slots_total", "Batch slots of the engine.", registry=reg)
    self.context_used = Gauge("horizon_context_tokens_used",
                              "Tokens held in the decode states of busy slots.", registry=reg)
    self.context_capacity = Gauge("horizon_context_tokens_capacity",
                                  "Decode-state capacity in tokens (slots x max_context).", registry=reg)
    self.prefix_reused_tokens = Counter(
        "horizon_prefix_cache_reused_tokens_total",
        "Prompt tokens loaded from the prefix cache instead of prefilled.", registry=reg)
    self.prefix_hit_rate = Gauge("horizon_prefix_cache_hit_rate",
                                 "Prefix-cache reused tokens / prompt tokens since start.", registry=reg)
    self.prefix_hit_rate.set_function(self._hit_rate)
    self.prefix_blocks = Gauge("horizon_prefix_cache_blocks", "Blocks in the prefix cache.", registry=reg)
    self.prefix_evictions = Counter("horizon_prefix_cache_evictions_total",
                                    "Prefix-cache blocks evicted to make room.", registry=reg)
    self.prefix_bytes = Gauge("horizon_prefix_cache_bytes", "Memory held by prefix-cache blocks.",
                              registry=reg)
    self.prefix_capacity = Gauge("horizon_prefix_cache_capacity_bytes", "The prefix cache's memory budget.",
                                 registry=reg)
    self.slots_total.set(slots)
    self.context_capacity.set(slots * max_context)
    self._evictions_seen = 0

  def observe(self, busy_lengths: list[int], waiting: int, prefix: Any | None) -> None:
    """Sets the gauges from the engine's state: the busy slots' cache lengths, the queue, the
    prefix cache (serving/prefix_cache.PrefixCache or None); evictions since the last call."""
    self.slots_used.set(len(busy_lengths))
    self.context_used.set(sum(busy_lengths))
    self.queue_length.set(waiting)
    if prefix is not None:
      self.prefix_blocks.set(len(prefix))
      self.prefix_bytes.set(prefix.nbytes)
      self.prefix_evictions.inc(prefix.evictions - self._evictions_seen)
      self._evictions_seen = prefix.evictions

  def _hit_rate(self) -> float:
    prompt = self.prompt_tokens.value()
    return self.prefix_reused_tokens.value() / prompt if prompt else 0.0

  def count_request(self, status: str) -> None:
    """One more request that ended (or was refused) with `status`."""
    self.requests.labels(status=status).inc()

  def render(self) -> str:
    """The Prometheus text exposition format 0.0.4."""
    return prometheus_client.generate_latest(self.registry).decode()

  def exposition(self, accept: str | None) -> tuple[bytes, str]:
    """(body, content type) in the format the scraper's Accept header asks for."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(self.registry), content_type
