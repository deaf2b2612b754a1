"""Benchmark: chunkwise (WY/UT) vs recurrent gated delta rule, and the chunked form before issue 16.

All forms compute the same function (tests/test_delta.py); this measures how their time grows
with sequence length. The recurrent form is t sequential rank-1 state updates; the chunked form
scans t / (C * chunks_per_step) steps, each doing its chunks' intra-chunk work as batched
matmuls and then carrying the state through them (t / C state updates in all). The `before`
column is the chunked form as it stood at --before_rev (default: row-by-row substitution loop,
autodiff through the inverse; --before_rev=d14f964: every chunk's intra-chunk work at once),
read from git so the old code is not kept alive in the library.

Run (heavy runs share the machine, so take the lock):

    flock /tmp/horizon_heavy.lock python -m experiments.bench.delta_chunked_vs_recurrent --issue
    python -m experiments.bench.delta_chunked_vs_recurrent --quick
    python -m experiments.bench.delta_chunked_vs_recurrent --mode=fwd_bwd   # training step

--issue runs issue 16's two targets: forward at 4K tokens (goal chunked >= 3x recurrent) and
forward + backward at 16K (goal >= 10x). Defaults are the `small` config's delta head sizes
(8 value heads, q/k repeated to them, kd = vd = 48, chunk 32).

Each form's time is the median over interleaved reps of wall time and of process CPU time
(all threads). On a shared machine the CPU time is the steadier figure: wall time then
mostly measures the scheduler. Peak memory is XLA's memory_analysis of the compiled function
(temp + arguments + outputs); a configuration needing more than 16 GiB is reported as skipped.

Prints a table and, as the last line, one JSON object with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench.common import compiled_peak_bytes, positive_int, skip_message
from model.attention.delta_rule import CHUNKS_PER_STEP, chunk_gated_delta_rule, recurrent_gated_delta_rule

BEFORE_REV = "f1bcca2"  # the last commit before issue 16's delta-rule change
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
  """Median wall seconds, min wall seconds and median process-CPU seconds per function.

  One warm-up call each, then `reps` rounds in which the forms alternate, so load from other
  processes on a shared machine hits all of them alike.
  """
  for fn in fns.values():
    jax.block_until_ready(fn(*args))
  wall = {name: [] for name in fns}
  cpu = {name: [] for name in fns}
  for _ in range(reps):
    for name, fn in fns.items():
      start, start_cpu = time.perf_counter(), time.process_time()
      jax.block_until_ready(fn(*args))
      wall[name].append(time.perf_counter() - start)
      cpu[name].append(time.process_time() - start_cpu)
  return {name: (statistics.median(wall[name]), min(wall[name]), statistics.median(cpu[name]))
          for name in fns}


def _with_grad(rule):
  """rule -> (q, k, v, g, beta) -> gradients of sum(o) + sum(final_state) w.r.t. all five."""
  def loss(*a):
    o, state = rule(*a)
    return jnp.sum(o) + jnp.sum(state)
  return jax.grad(loss, argnums=tuple(range(5)))


def measure_forms(forms: dict, x: tuple, reps: int) -> tuple[dict, dict]:
  """Compiles each form (not timed), records planned bytes, times those that fit, interleaved.

  Returns (row with {name}_bytes / {name}_s / {name}_min_s / {name}_cpu_s / {name}_skipped,
  {name: compiled program} of the forms that ran).
  """
  row, runnable = {}, {}
  for name, fn in forms.items():
    compiled = jax.jit(fn).lower(*x).compile()
    peak = compiled_peak_bytes(compiled)
    row[f"{name}_bytes"] = peak
    row[f"{name}_s"] = row[f"{name}_cpu_s"] = None
    skipped = skip_message(peak, SKIP_BYTES)
    if skipped:
      row[f"{name}_skipped"] = skipped
    else:
      runnable[name] = compiled
  for name, (median, best, cpu) in _time_interleaved(runnable, x, reps).items():
    row[f"{name}_s"], row[f"{name}_min_s"], row[f"{name}_cpu_s"] = median, best, cpu
  return row, runnable


def chunked_before(rev: str):
  """The chunked rule as of git revision `rev` (a module built from `git show`), or None.

  None when git or the revision is not available (e.g. an exported tree); the table then
  leaves the column out.
  """
  root = pathlib.Path(__file__).resolve().parents[2]
  try:
    src = subprocess.run(["git", "show", f"{rev}:model/attention/delta_rule.py"], cwd=root,
                         capture_output=True, text=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    return None
  module = types.ModuleType(f"delta_rule_at_{rev}")
  exec(compile(src, f"{rev}:model/attention/delta_rule.py", "exec"), module.__dict__)  # noqa: S102
  return module.chunk_gated_delta_rule


def _ratios(row: dict) -> None:
  """Adds recurrent / chunked (and before / chunked) ratios of wall and CPU medians to row."""
  for other, key in (("recurrent", "speedup"), ("before", "speedup_vs_before")):
    for suffix, tag in (("_s", ""), ("_cpu_s", "_cpu")):
      if row.get(f"chunked{suffix}") and row.get(f"{other}{suffix}"):
        row[f"{key}{tag}"] = row[f"{other}{suffix}"] / row[f"chunked{suffix}"]


def _bench_one(n: int, mode: str, args: argparse.Namespace) -> dict:
  x = _inputs(n, args.batch, args.heads, args.kd, args.vd)
  rules = {
      "chunked": lambda *a: chunk_gated_delta_rule(*a, chunk_size=args.chunk,
                                                   chunks_per_step=args.chunks_per_step),
      "recurrent": recurrent_gated_delta_rule,
  }
  before = chunked_before(args.before_rev) if args.before_rev else None
  if before is not None:
    rules["before"] = lambda *a: before(*a, chunk_size=args.chunk)
  wrap = _with_grad if mode == "fwd_bwd" else (lambda rule: rule)
  row, _ = measure_forms({name: wrap(rule) for name, rule in rules.items()}, x, args.reps)
  row = {"n": n, "mode": mode, **row}
  _ratios(row)
  return row


def _fmt(seconds) -> str:
  return "   skipped" if seconds is None else f"{seconds * 1e3:10.1f}"


def _ratio(row: dict, key: str) -> str:
  return f"{row[key]:7.2f}" if key in row else "    n/a"


def _print_table(rows: list[dict], args: argparse.Namespace) -> None:
  load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
  print(f"gated delta rule, f32, backend={jax.default_backend()}, b={args.batch}, h={args.heads}, "
        f"kd={args.kd}, vd={args.vd}, chunk={args.chunk}, chunks/step={args.chunks_per_step}, "
        f"median of {args.reps}, before={args.before_rev}, "
        f"load average {load:.1f} on {os.cpu_count()} CPUs")
  print("| mode | N | chunked ms (cpu) | recurrent ms (cpu) | before ms (cpu) | rec/chunked wall | "
        "rec/chunked cpu | before/chunked cpu | chunked MiB | recurrent MiB |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    cols = [f"{_fmt(r.get(f'{f}_s'))} ({_fmt(r.get(f'{f}_cpu_s')).strip()})"
            if f"{f}_bytes" in r else "not run" for f in ("chunked", "recurrent", "before")]
    print(f"| {r['mode']} | {r['n']} | {' | '.join(cols)} | {_ratio(r, 'speedup')} | "
          f"{_ratio(r, 'speedup_cpu')} | {_ratio(r, 'speedup_vs_before_cpu')} | "
          f"{r['chunked_bytes'] / 2 ** 20:.1f} | {r['recurrent_bytes'] / 2 ** 20:.1f} |")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--lengths", default="1024,4096,16384", help="comma-separated sequence lengths")
  p.add_argument("--quick", action="store_true", help="small sizes: lengths 256,1024")
  p.add_argument("--issue", action="store_true",
                 help="issue 16's targets: fwd at 4096 and fwd_bwd at 16384 (ignores --lengths/--mode)")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=8, help="value heads (small config: 8)")
  p.add_argument("--kd", type=int, default=48, help="q/k head dim (small config: 48)")
  p.add_argument("--vd", type=int, default=48, help="value head dim (small config: 48)")
  p.add_argument("--chunk", type=int, default=32, help="tokens per chunk (small config: 32)")
  p.add_argument("--chunks_per_step", type=int, default=CHUNKS_PER_STEP,
                 help="chunks per scan step of the chunked form")
  p.add_argument("--reps", type=positive_int, default=7)
  p.add_argument("--before_rev", default=BEFORE_REV, help="git revision of the 'before' chunked form; "
                 "empty to leave it out")
  p.add_argument("--mode", choices=("fwd", "fwd_bwd"), default="fwd",
                 help="time the forward, or forward + backward (training)")
  args = p.parse_args()
  if args.issue:
    runs = [(4096, "fwd"), (16384, "fwd_bwd")]
  else:
    lengths = [256, 1024] if args.quick else [int(s) for s in args.lengths.split(",")]
    runs = [(n, args.mode) for n in lengths]

  rows = [_bench_one(n, mode, args) for n, mode in runs]
  _print_table(rows, args)
  print(json.dumps({
      "bench": "delta_chunked_vs_recurrent",
      "backend": jax.default_backend(),
      "config": {"batch": args.batch, "heads": args.heads, "kd": args.kd, "vd": args.vd,
                 "chunk": args.chunk, "chunks_per_step": args.chunks_per_step, "dtype": "float32",
                 "before_rev": args.before_rev},
      "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
      "rows": rows,
      "speedup": {f"{r['mode']}@{r['n']}": round(r["speedup"], 3) for r in rows if "speedup" in r},
      "speedup_cpu": {f"{r['mode']}@{r['n']}": round(r["speedup_cpu"], 3)
                      for r in rows if "speedup_cpu" in r},
      "speedup_vs_before_cpu": {f"{r['mode']}@{r['n']}": round(r["speedup_vs_before_cpu"], 3)
                                for r in rows if "speedup_vs_before_cpu" in r},
  }))


if __name__ == "__main__":
  main()
