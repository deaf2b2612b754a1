"""Decode throughput with more requests than slots: run-ahead while requests wait vs one step per call.

    python -m experiments.bench.queued_decode            # small, 8 slots, 24 requests
    python -m experiments.bench.queued_decode --quick    # tiny (seconds)

When every slot is busy and requests queue, the engine once ran one decode step per device call
(so that a freed slot would be taken at once); now a call runs up to `decode_steps` steps and ends
at the step where its first row stops (serving/decode_loop.run_ahead, `yield_on_stop`), which frees
the slot at the same token. Two engines on the same random weights serve the same requests (greedy,
max_tokens spread over [--min_tokens, --max_tokens], the bos id as the only stop id, so every request
runs its max_tokens): the baseline with the old rule restored for it alone, and the engine as it is.
Reported: generated tokens / wall time from the first submit to the last token (median of
--repeats), decode calls and tokens per call; last line: JSON with the ratio.
"""

from __future__ import annotations

import json
import time

import numpy as np
from absl import app, flags

from configs import serve
from experiments.bench.common import quick_flag, report_cpu
from serving.build import build_engine
from serving.engine import Engine, Request
from serving.types import SamplingParams

_QUICK = quick_flag("tiny model, fewer requests.")
_SLOTS = flags.DEFINE_integer("slots", 8, "Engine slots.")
_REQUESTS = flags.DEFINE_integer("requests", 24, "Requests submitted at once (more than slots: a queue).")
_PROMPT = flags.DEFINE_integer("prompt", 64, "Prompt tokens per request.")
_MIN = flags.DEFINE_integer("min_tokens", 16, "Fewest generated tokens per request.")
_MAX = flags.DEFINE_integer("max_tokens", 64, "Most generated tokens per request.")
_STEPS = flags.DEFINE_integer("decode_steps", 8, "Most decode steps per device call.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per engine (the median is reported).",
                                lower_bound=1)


class _OneStepWhileWaiting(Engine):
  """The rule before: no run-ahead while a request waits for a slot."""

  def _decode_and_sample(self, pre) -> None:
    waiting = self._n_waiting()
    steps, self.decode_steps = self.decode_steps, (1 if waiting else self.decode_steps)
    try:
      super()._decode_and_sample(pre)
    finally:
      self.decode_steps = steps


def _counting(engine: Engine) -> list[int]:
  """Wraps the engine's decode program; the returned list gets each call's max_steps."""
  calls, program = [], engine._fns["decode_loop"]

  def counted(*args):
    calls.append(int(args[-2]))
    return program(*args)
  engine._fns["decode_loop"] = counted
  return calls


def serve_all(engine: Engine, n: int, prompt: int, lo: int, hi: int, seed: int) -> tuple[float, int]:
  """(seconds from the first submit to the last token, tokens generated) for n queued requests."""
  rng = np.random.default_rng(seed)
  bos = engine.tokenizer.special_id("bos")
  lengths = rng.integers(lo, hi + 1, n)
  t0 = time.time()  # events are stamped with time.time()
  handles = [engine.submit(Request([int(t) for t in rng.integers(3, 300, prompt)],
                                   SamplingParams(max_tokens=int(m), temperature=0.0, stop_token_ids=[bos])))
             for m in lengths]
  tokens, last = 0, t0
  for h in handles:
    for ev in h.events():
      tokens += len(ev.token_ids)
      last = max(last, ev.time)
  return last - t0, tokens


def main(argv) -> None:
  del argv
  quick = _QUICK.value
  slots, n = (4, 12) if quick else (_SLOTS.value, _REQUESTS.value)
  prompt, lo, hi = (16, 4, 16) if quick else (_PROMPT.value, _MIN.value, _MAX.value)
  config = serve.get_config("tiny" if quick else "small")
  context = prompt + hi + 8
  config.serving.update(slots=slots, max_context=context, prefix_cache_mb=0, decode_steps=_STEPS.value)
  now = build_engine(config)
  before = _OneStepWhileWaiting(now.model, now.tokenizer, slots=now.slots, max_context=context,
                                prefill_chunk=now.prefill_chunk, decode_steps=_STEPS.value,
                                batch_invariant=config.serving.batch_invariant)
  engines = (("one step while waiting", before), ("run ahead, yield on stop", now))
  runs: dict[str, list] = {name: [] for name, _ in engines}
  calls = {}
  for name, engine in engines:
    engine.start()
    serve_all(engine, n, prompt, lo, hi, seed=7)  # the timed run once: compiles every program it meets
    calls[name] = _counting(engine)
  try:
    for _ in range(_REPEATS.value):  # interleaved, so that a slow spell of the machine hits both
      for name, engine in engines:
        runs[name].append(serve_all(engine, n, prompt, lo, hi, seed=7))
  finally:
    for _, engine in engines:
      engine.stop()
  rows = []
  for name, _ in engines:
    seconds = float(np.median([s for s, _ in runs[name]]))
    tokens = runs[name][0][1]
    assert all(t == tokens for _, t in runs[name]), "every run generates the same tokens"
    rows.append({"engine": name, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                 "calls": len(calls[name]) / len(runs[name]),
                 "tokens_per_call": tokens * len(runs[name]) / max(1, len(calls[name]))})
  cpu = report_cpu()
  print(f"model {config.serving.model_name} (random weights), {slots} slots, {n} requests of "
        f"{lo}-{hi} tokens after {prompt}-token prompts, up to {_STEPS.value} steps per call")
  print(f"{'engine':>26} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'calls':>7} {'tok/call':>9}")
  for r in rows:
    print(f"{r['engine']:>26} {r['tokens']:>7} {r['seconds']:>8.2f} {r['tokens_per_s']:>8.1f} "
          f"{r['calls']:>7.0f} {r['tokens_per_call']:>9.2f}")
  print(json.dumps({"model": config.serving.model_name, "cpu": cpu, "slots": slots, "requests": n,
                    "tokens_per_s": {r["engine"]: round(r["tokens_per_s"], 1) for r in rows},
                    "ratio": round(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"], 3)}))


if __name__ == "__main__":
  app.run(main)
