"""Engine metrics: thread-safe counters, gauges and histograms, rendered as Prometheus text.

Why our own ~100 lines instead of `prometheus_client`: the engine needs a
handful of series, updated from its loop thread and read by the HTTP thread;
a private registry per engine (tests build several engines in one process)
and no global state are simpler to get right here than the client library's
process-wide default registry. The output follows the Prometheus text
exposition format 0.0.4 (`# HELP`, `# TYPE`, `name{label="v"} value`,
histogram `_bucket{le=...}` / `_sum` / `_count`).

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

There is no prefix cache (every request prefills its whole prompt into a
zeroed slot), so no prefix-cache hit rate is reported.
"""

from __future__ import annotations

import bisect
import math
import threading

# Latency buckets (seconds): 1 ms .. 60 s, roughly x2.5 apart.
LATENCY_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                                      2.5, 5.0, 10.0, 30.0, 60.0)


def _fmt(v: float) -> str:
  if math.isinf(v):
    return "+Inf" if v > 0 else "-Inf"
  if float(v).is_integer() and abs(v) < 1e15:
    return str(int(v))
  return repr(float(v))


def _labels(labels: dict[str, str]) -> str:
  if not labels:
    return ""
  esc = lambda s: str(s).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
  return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in sorted(labels.items())) + "}"


class Counter:
  """A monotonically increasing value per label set."""

  kind = "counter"

  def __init__(self, name: str, help_: str, lock: threading.Lock):
    self.name, self.help, self._lock = name, help_, lock
    self._values: dict[tuple, float] = {}

  def inc(self, amount: float = 1.0, **labels: str) -> None:
    if amount < 0:
      raise ValueError(f"{self.name}: a counter cannot decrease (amount={amount}).")
    key = tuple(sorted(labels.items()))
    with self._lock:
      self._values[key] = self._values.get(key, 0.0) + amount

  def value(self, **labels: str) -> float:
    with self._lock:
      return self._values.get(tuple(sorted(labels.items())), 0.0)

  def _lines(self) -> list[str]:
    if not self._values:
      return [f"{self.name} 0"]
    return [f"{self.name}{_labels(dict(k))} {_fmt(v)}" for k, v in sorted(self._values.items())]


class Gauge:
  """A value that goes up and down (set by its owner)."""

  kind = "gauge"

  def __init__(self, name: str, help_: str, lock: threading.Lock):
    self.name, self.help, self._lock = name, help_, lock
    self._value = 0.0

  def set(self, value: float) -> None:
    with self._lock:
      self._value = float(value)

  def value(self) -> float:
    with self._lock:
      return self._value

  def _lines(self) -> list[str]:
    return [f"{self.name} {_fmt(self._value)}"]


class Histogram:
  """Cumulative buckets + sum + count (Prometheus histogram)."""

  kind = "histogram"

  def __init__(self, name: str, help_: str, lock: threading.Lock,
               buckets: tuple[float, ...] = LATENCY_BUCKETS):
    if list(buckets) != sorted(buckets) or not buckets:
      raise ValueError(f"{name}: buckets must be a non-empty increasing sequence, got {buckets}.")
    self.name, self.help, self._lock = name, help_, lock
    self.buckets = tuple(buckets)
    self._counts = [0] * (len(buckets) + 1)  # last = +Inf only
    self._sum = 0.0

  def observe(self, value: float) -> None:
    i = bisect.bisect_left(self.buckets, value)
    with self._lock:
      self._counts[i] += 1
      self._sum += value

  @property
  def count(self) -> int:
    with self._lock:
      return sum(self._counts)

  @property
  def sum(self) -> float:
    with self._lock:
      return self._sum

  def _lines(self) -> list[str]:
    out, total = [], 0
    for le, c in zip(self.buckets + (math.inf,), self._counts, strict=True):
      total += c
      out.append(f'{self.name}_bucket{{le="{_fmt(le)}"}} {total}')
    out += [f"{self.name}_sum {_fmt(self._sum)}", f"{self.name}_count {total}"]
    return out


class EngineMetrics:
  """The engine's series (see the module docstring); `render()` is safe from any thread."""

  def __init__(self, slots: int, max_context: int):
    self._lock = threading.Lock()
    lk = self._lock
    self.requests = Counter("horizon_requests_total",
                            "Requests by outcome (finish reason, rejected, overloaded).", lk)
    self.prompt_tokens = Counter("horizon_prompt_tokens_total", "Prompt tokens of admitted requests.", lk)
    self.generation_tokens = Counter("horizon_generation_tokens_total", "Generated tokens.", lk)
    self.ttft = Histogram("horizon_time_to_first_token_seconds",
                          "Seconds from submission to the first generated token.", lk)
    self.itl = Histogram("horizon_inter_token_latency_seconds",
                         "Seconds between consecutive generated tokens of a request.", lk)
    self.queue_length = Gauge("horizon_queue_length", "Requests waiting for a free slot.", lk)
    self.slots_used = Gauge("horizon_slots_used", "Batch slots holding a request.", lk)
    self.slots_total = Gauge("horizon_slots_total", "Batch slots of the engine.", lk)
    self.context_used = Gauge("horizon_context_tokens_used",
                              "Tokens held in the decode states of busy slots.", lk)
    self.context_capacity = Gauge("horizon_context_tokens_capacity",
                                  "Decode-state capacity in tokens (slots x max_context).", lk)
    self.slots_total.set(slots)
    self.context_capacity.set(slots * max_context)
    self._all = (self.requests, self.prompt_tokens, self.generation_tokens, self.ttft, self.itl,
                 self.queue_length, self.slots_used, self.slots_total, self.context_used,
                 self.context_capacity)

  def render(self) -> str:
    """Prometheus text exposition format (content type `text/plain; version=0.0.4`)."""
    lines = []
    with self._lock:
      for m in self._all:
        lines += [f"# HELP {m.name} {m.help}", f"# TYPE {m.name} {m.kind}"] + m._lines()
    return "\n".join(lines) + "\n"
