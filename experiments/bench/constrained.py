"""Benchmark: tool-call constraint masks, trie walk + string fast path vs per-token simulation.

Drives ToolCallConstraint with random allowed tokens (the `small` tokenizer: 8192 ids, the
size the spec's < 20 ms per `next()` target is about) over a few schemas, records every JSON
automaton state reached, then computes each state's mask cold (no memo) both ways: the fast
path (serving.constrained._compute_mask) and the reference that simulates every token's
text on its own (_reference_mask). They must agree; the table gives milliseconds per mask
(per state the median of 3 cold computations).
It also reports `next()` as the engine sees it (memoised, forced ids included).

    python -m experiments.bench.constrained --quick
    flock /tmp/horizon_heavy.lock python -m experiments.bench.constrained

Prints a table and, as the last line, one JSON object with the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from serving import constrained
from serving.types import Tool, ToolChoice
from training.tokenizer import default_tokenizer_path, load_tokenizer

_TOOLS = [
    Tool("get_weather", "", {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}}}),
    Tool("plot", "", {"type": "object", "required": ["xs", "title"], "properties": {
        "xs": {"type": "array", "items": {"type": "number"}}, "title": {"type": "string"},
        "log": {"type": "boolean"}}}),
    Tool("store", "", {"type": "object", "required": ["key", "value"], "properties": {
        "key": {"type": "string", "maxLength": 16}, "value": {"anyOf": [{"type": "object"}]},
        "meta": {"type": "object", "properties": {"ttl": {"type": "integer"}, "tags": {
            "type": "array", "items": {"type": "string"}}}}}}),
]


def _drive(tok, rng, runs: int):
  """Random drives: (JSON states reached, seconds of every next() call)."""
  states, calls = [], []
  for _ in range(runs):
    c = constrained.ToolCallConstraint(tok, _TOOLS, ToolChoice("required"))
    while not c.done:
      if c._phase == 1:
        states.append(c._stack)
      start = time.perf_counter()
      allowed = c.next()
      calls.append(time.perf_counter() - start)
      c.advance(int(rng.choice(np.flatnonzero(allowed))) if isinstance(allowed, np.ndarray) else allowed)
  return states, calls


def _time(fn, vocab, states, reps: int = 3) -> list[float]:
  """Per state: the median seconds of `reps` cold computations (the machine is shared)."""
  out = []
  for stack in states:
    times = []
    for _ in range(reps):
      start = time.perf_counter()
      fn(vocab, stack)
      times.append(time.perf_counter() - start)
    out.append(statistics.median(times))
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="few drives and states")
  parser.add_argument("--variant", default="small", help="bundled tokenizer (tiny/small)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  runs, n_ref = (6, 40) if args.quick else (40, 300)
  tok = load_tokenizer(default_tokenizer_path(args.variant))
  start = time.perf_counter()
  constrained._vocab(constrained._TokKey(tok))
  vocab_s = time.perf_counter() - start
  rng = np.random.default_rng(args.seed)
  states, calls = _drive(tok, rng, runs)
  vocab = constrained._vocab(constrained._TokKey(tok))
  distinct = list(dict.fromkeys(states))
  sample = [distinct[i] for i in sorted(rng.choice(len(distinct), min(n_ref, len(distinct)), replace=False))]
  for stack in sample:
    if not np.array_equal(constrained._compute_mask(vocab, stack), constrained._reference_mask(vocab, stack)):
      raise AssertionError("fast and reference masks differ")
  fast_all = _time(constrained._compute_mask, vocab, distinct)
  fast = _time(constrained._compute_mask, vocab, sample)
  ref = _time(constrained._reference_mask, vocab, sample)
  ms = lambda xs, q: 1e3 * float(np.quantile(xs, q))  # noqa: E731
  rows = [("fast, all states", fast_all), ("fast, sample", fast), ("reference, sample", ref),
          ("next() (memoised)", calls)]
  print(f"tokenizer {args.variant} ({tok.vocab_size} ids), token texts precomputed in "
        f"{vocab_s * 1e3:.0f} ms; "
        f"{runs} drives, {len(calls)} next() calls, {len(distinct)} distinct JSON states")
  print(f"{'mask':<20} {'n':>6} {'median ms':>10} {'p90 ms':>8} {'max ms':>8}")
  for name, xs in rows:
    print(f"{name:<20} {len(xs):>6} {ms(xs, 0.5):>10.3f} {ms(xs, 0.9):>8.3f} {1e3 * max(xs):>8.3f}")
  print(json.dumps({
      "vocab_size": tok.vocab_size, "fast_mask_ms_median": round(ms(fast_all, 0.5), 4),
      "fast_mask_ms_max": round(1e3 * max(fast_all), 3), "next_ms_max": round(1e3 * max(calls), 3),
      "reference_over_fast_median": round(statistics.median(
          r / f for r, f in zip(ref, fast, strict=True)), 1),
      "reference_over_fast_total": round(sum(ref) / sum(fast), 1)}))


if __name__ == "__main__":
  main()
