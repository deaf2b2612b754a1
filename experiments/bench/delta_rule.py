"""Benchmark: Pallas gated delta rule kernel vs the XLA chunked (WY/UT) reference, f32.

Both compute model/attention/delta_rule.py:chunk_gated_delta_rule (tests/test_kernel_delta_rule.py
checks outputs and every gradient); this times them side by side in one process, forward or
forward + backward, and reports XLA's planned memory (memory_analysis: temp + arguments +
outputs) of each compiled program. On CPU the kernel runs in Pallas interpret mode (the kernel
body executed as XLA loops), so its CPU times say nothing about kernel speed; the table says so.
The real numbers come from a TPU or GPU run.

Run (heavy runs share the machine, so take the lock):

    flock /tmp/horizon_heavy.lock python -m experiments.bench.delta_rule --quick
    flock /tmp/horizon_heavy.lock python -m experiments.bench.delta_rule --mode=fwd_bwd
    python -m experiments.bench.delta_rule --lengths=8192,32768 --heads=64 --kd=128 --vd=128 --chunk=64

Prints a table and, as the last line, one JSON object with the ratios (reference time / kernel
time: > 1 means the kernel is faster).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench.common import positive_int
from experiments.bench.delta_chunked_vs_recurrent import _inputs, _with_grad, measure_forms
from model.attention.delta_rule import chunk_gated_delta_rule as xla_rule
from pallas_kernels.delta_rule import chunk_gated_delta_rule as pallas_rule

SKIP_BYTES = 16 * 2 ** 30  # configs needing more than this (by memory_analysis) are not run


def _max_rel_err(a, b) -> float:
  """Largest relative Frobenius error over matching leaves of two result trees."""
  errs = [float(jnp.linalg.norm(x - y) / jnp.maximum(jnp.linalg.norm(y), 1e-30))
          for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)]
  return max(errs)


def _bench_one(n: int, args: argparse.Namespace) -> dict:
  q, k, v, g, beta = _inputs(n, args.batch, args.heads, args.kd, args.vd)
  rng = np.random.default_rng(1)
  reset = jnp.asarray(rng.random((args.batch, n)) < 1.0 / 512)  # a few packed-segment starts
  x = (q, k, v, g, beta)
  rules = {
      "kernel": lambda *a: pallas_rule(*a, reset=reset, chunk_size=args.chunk),
      "xla": lambda *a: xla_rule(*a, reset=reset, chunk_size=args.chunk),
  }
  wrap = _with_grad if args.mode == "fwd_bwd" else (lambda rule: rule)
  row, runnable = measure_forms({name: wrap(rule) for name, rule in rules.items()}, x, args.reps)
  row = {"n": n, **row}
  if row["kernel_s"] and row["xla_s"]:
    row["speedup"] = row["xla_s"] / row["kernel_s"]
    row["max_rel_err"] = _max_rel_err(runnable["kernel"](*x), runnable["xla"](*x))
  return row


def _fmt(seconds) -> str:
  return "   skipped" if seconds is None else f"{seconds * 1e3:10.2f}"


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--lengths", default="1024,4096,8192", help="comma-separated sequence lengths")
  p.add_argument("--quick", action="store_true", help="small sizes: lengths 128,256, 2 heads, 2 reps")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=8, help="value heads (small config: 8)")
  p.add_argument("--kd", type=int, default=48)
  p.add_argument("--vd", type=int, default=48)
  p.add_argument("--chunk", type=int, default=32)
  p.add_argument("--reps", type=positive_int, default=5)
  p.add_argument("--mode", choices=("fwd", "fwd_bwd"), default="fwd",
                 help="time the forward, or forward + backward (training)")
  args = p.parse_args()
  lengths = [int(s) for s in args.lengths.split(",")]
  if args.quick:
    lengths, args.heads, args.reps = [128, 256], 2, 2
  backend = jax.default_backend()
  interpreted = backend == "cpu"

  rows = [_bench_one(n, args) for n in lengths]
  print(f"gated delta rule {args.mode}, f32, backend={backend}, b={args.batch}, h={args.heads}, "
        f"kd={args.kd}, vd={args.vd}, chunk={args.chunk}, median of {args.reps}")
  if interpreted:
    print("NOTE: CPU runs the Pallas kernel in interpret mode (the kernel body as XLA loops): "
          "its times are slow and are NOT kernel timings; run on a TPU/GPU for those.")
  print(f"{'N':>6} | {'kernel ms':>10} | {'xla ms':>10} | {'xla/kernel':>10} | {'kernel MiB':>10} | "
        f"{'xla MiB':>8} | {'max rel err':>11}")
  for r in rows:
    speed = f"{r['speedup']:10.3f}" if "speedup" in r else "       n/a"
    err = f"{r['max_rel_err']:11.2e}" if "max_rel_err" in r else "        n/a"
    print(f"{r['n']:>6} | {_fmt(r['kernel_s'])} | {_fmt(r['xla_s'])} | {speed} | "
          f"{r['kernel_bytes'] / 2 ** 20:10.1f} | {r['xla_bytes'] / 2 ** 20:8.1f} | {err}")
  print(json.dumps({
      "bench": "delta_rule",
      "backend": backend,
      "kernel_mode": "interpret" if interpreted else "compiled",
      "mode": args.mode,
      "config": {"batch": args.batch, "heads": args.heads, "kd": args.kd, "vd": args.vd,
                 "chunk": args.chunk, "dtype": "float32"},
      "rows": rows,
      "speedup_xla_over_kernel": {str(r["n"]): round(r["speedup"], 4) for r in rows if "speedup" in r},
  }))


if __name__ == "__main__":
  main()
