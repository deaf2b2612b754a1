"""Benchmark: chunkwise (WY/UT) vs recurrent gated delta rule, jitted, f32.

Both forms compute the same function (tests/test_delta.py); this measures how their time
grows with sequence length. The recurrent form is t sequential rank-1 state updates; the
chunked form does t/C sequential steps of small matmuls plus parallel intra-chunk work.

Run (heavy runs share the machine, so take the lock):

    flock /tmp/horizon_heavy.lock python -m experiments.bench.delta_chunked_vs_recurrent
    python -m experiments.bench.delta_chunked_vs_recurrent --quick
    python -m experiments.bench.delta_chunked_vs_recurrent --mode=fwd_bwd   # training step

Peak memory is XLA's memory_analysis of the compiled function (temp + arguments + outputs);
a configuration needing more than 16 GiB is reported as skipped instead of run.

Prints a table and, as the last line, one JSON object with the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench.common import compiled_peak_bytes, skip_message
from model.attention.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule

SKIP_BYTES = 16 * 2 ** 30  # configs needing more than this (by memory_analysis) are not run


def _inputs(n: int, b: int, h: int, kd: int, vd: int, seed: int = 0):
  """Random f32 q, k (L2-normalised, q scaled), v, g <= 0, beta in (0, 1)."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, n, h, kd), np.float32)
  k = rng.standard_normal((b, n, h, kd), np.float32)
  q = q / np.linalg.norm(q, axis=-1, keepdims=True) * kd ** -0.5
  k = k / np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.standard_normal((b, n, h, vd), np.float32)
  g = -rng.uniform(0.001, 0.1, (b, n, h)).astype(np.float32)
  beta = rng.uniform(0.0, 1.0, (b, n, h)).astype(np.float32)
  return tuple(jnp.asarray(x) for x in (q, k, v, g, beta))


def _time_interleaved(fns: dict, args, reps: int) -> dict:
  """Median and min seconds per function over `reps` rounds, after one warm-up call each.

  The forms alternate within each round so load from other processes on a shared machine
  hits both alike.
  """
  for fn in fns.values():
    jax.block_until_ready(fn(*args))
  times = {name: [] for name in fns}
  for _ in range(reps):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - start)
  return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}


def _with_grad(rule):
  """rule -> (q, k, v, g, beta) -> gradients of sum(o) + sum(final_state) w.r.t. all five."""
  def loss(*a):
    o, state = rule(*a)
    return jnp.sum(o) + jnp.sum(state)
  return jax.grad(loss, argnums=tuple(range(5)))


def measure_forms(forms: dict, x: tuple, reps: int) -> tuple[dict, dict]:
  """Compiles each form (not timed), records planned bytes, times those that fit, interleaved.

  Returns (row with {name}_bytes / {name}_s / {name}_min_s / {name}_skipped,
  {name: compiled program} of the forms that ran).
  """
  row, runnable = {}, {}
  for name, fn in forms.items():
    compiled = jax.jit(fn).lower(*x).compile()
    peak = compiled_peak_bytes(compiled)
    row[f"{name}_bytes"] = peak
    row[f"{name}_s"] = None
    skipped = skip_message(peak, SKIP_BYTES)
    if skipped:
      row[f"{name}_skipped"] = skipped
    else:
      runnable[name] = compiled
  for name, (median, best) in _time_interleaved(runnable, x, reps).items():
    row[f"{name}_s"], row[f"{name}_min_s"] = median, best
  return row, runnable


def _bench_one(n: int, args: argparse.Namespace) -> dict:
  x = _inputs(n, args.batch, args.heads, args.kd, args.vd)
  rules = {
      "chunked": lambda *a: chunk_gated_delta_rule(*a, chunk_size=args.chunk),
      "recurrent": recurrent_gated_delta_rule,
  }
  wrap = _with_grad if args.mode == "fwd_bwd" else (lambda rule: rule)
  row, _ = measure_forms({name: wrap(rule) for name, rule in rules.items()}, x, args.reps)
  row = {"n": n, **row}
  if row["chunked_s"] and row["recurrent_s"]:
    row["speedup"] = row["recurrent_s"] / row["chunked_s"]
  return row


def _growth(rows: list[dict], key: str) -> dict:
  out = {}
  for prev, cur in zip(rows, rows[1:], strict=False):
    if prev[key] and cur[key]:
      out[f"{cur['n']}/{prev['n']}"] = round(cur[key] / prev[key], 3)
  return out


def _fmt(seconds) -> str:
  return "skipped" if seconds is None else f"{seconds * 1e3:10.2f}"


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--lengths", default="1024,4096,16384", help="comma-separated sequence lengths")
  p.add_argument("--quick", action="store_true", help="small sizes: lengths 256,1024")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kd", type=int, default=64)
  p.add_argument("--vd", type=int, default=64)
  p.add_argument("--chunk", type=int, default=64)
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--mode", choices=("fwd", "fwd_bwd"), default="fwd",
                 help="time the forward, or forward + backward (training)")
  args = p.parse_args()
  lengths = [256, 1024] if args.quick else [int(s) for s in args.lengths.split(",")]

  rows = [_bench_one(n, args) for n in lengths]
  print(f"gated delta rule {args.mode}, f32, backend={jax.default_backend()}, b={args.batch}, "
        f"h={args.heads}, kd={args.kd}, vd={args.vd}, chunk={args.chunk}, median of {args.reps}")
  print(f"{'N':>7} | {'chunked ms':>10} | {'recurrent ms':>12} | {'speedup':>7} | "
        f"{'chunked MiB':>11} | {'recurrent MiB':>13}")
  for r in rows:
    speed = f"{r['speedup']:7.2f}" if "speedup" in r else "    n/a"
    print(f"{r['n']:>7} | {_fmt(r['chunked_s'])} | {_fmt(r['recurrent_s']):>12} | {speed} | "
          f"{r['chunked_bytes'] / 2 ** 20:11.1f} | {r['recurrent_bytes'] / 2 ** 20:13.1f}")
  growth_c, growth_r = _growth(rows, "chunked_s"), _growth(rows, "recurrent_s")
  for key in growth_c:
    print(f"growth {key}: chunked x{growth_c[key]:.2f}, recurrent x{growth_r.get(key, float('nan')):.2f}")
  print(json.dumps({
      "bench": "delta_chunked_vs_recurrent",
      "backend": jax.default_backend(),
      "mode": args.mode,
      "config": {"batch": args.batch, "heads": args.heads, "kd": args.kd, "vd": args.vd,
                 "chunk": args.chunk, "dtype": "float32"},
      "rows": rows,
      "speedup": {str(r["n"]): round(r["speedup"], 3) for r in rows if "speedup" in r},
      "growth_chunked": growth_c,
      "growth_recurrent": growth_r,
  }))


if __name__ == "__main__":
  main()
