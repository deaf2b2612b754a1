"""Dropless grouped-matmul experts vs running every expert on every token.

Run (under the heavy-job lock on shared machines):

    flock /tmp/horizon_heavy.lock python -m experiments.bench.moe_dropless_vs_dense
    python -m experiments.bench.moe_dropless_vs_dense --config small --dtypes float32
    python -m experiments.bench.moe_dropless_vs_dense --quick

Times `model.moe_experts.dropless_experts` ('grouped', the training path; 'blocked', the
old path with a copy of the expert weights per block; optionally 'ragged_dot') against
`model.moe_experts.dense_experts_reference` on the same random routing, jitted, forward and
forward+backward. Default sizes are E=64 experts, top-6 (the issue-16 goal: grouped vs dense
>= 6x, limit E/k = 10.7x); `--config small` uses the `small` model's MoE sizes (2,048 tokens
= 8 x 256). The decode rows time t=1 and t=16 tokens, forward only: 'gather' (reads the t*k
selected experts) and 'grouped' vs the old 'blocked'.

Cases of one mode run round-robin, one call each per round, so load drift on a shared
machine hits them alike; warm-up (compile + first run) is excluded and the median of --reps
rounds is reported. Peak memory is XLA's `memory_analysis()` (temp + arguments + outputs);
a case above --max_gib is reported as skipped, not run. The last line is a JSON object of
ratios (> 1 means faster than the baseline named in the key).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp

from experiments.bench.common import compiled_peak_bytes, positive_int, skip_message
from model import moe_experts

CONFIGS = {"e64k6": dict(tokens=4096, d=512, f=256, experts=64, topk=6),
           "small": dict(tokens=2048, d=384, f=256, experts=32, topk=4)}
DECODE_TOKENS = (1, 16)
DECODE_IMPLS = ("blocked", "grouped", "gather")


def _inputs(tokens: int, d: int, f: int, e: int, k: int, dtype):
  ks = jax.random.split(jax.random.key(0), 7)
  x = jax.random.normal(ks[0], (tokens, d), jnp.float32).astype(dtype)
  logits = jax.random.normal(ks[1], (tokens, e), jnp.float32)
  weights, idx = jax.lax.top_k(jax.nn.sigmoid(logits), k)
  weights = weights / jnp.sum(weights, -1, keepdims=True)
  wg = (jax.random.normal(ks[2], (e, d, f)) * d ** -0.5).astype(dtype)
  wu = (jax.random.normal(ks[3], (e, d, f)) * d ** -0.5).astype(dtype)
  wd = (jax.random.normal(ks[4], (e, f, d)) * f ** -0.5).astype(dtype)
  cot = jax.random.normal(ks[5], (tokens, d), jnp.float32)
  return (x, idx.astype(jnp.int32), weights, wg, wu, wd), cot


def _fn(impl: str, mode: str, dtype, cot):
  if impl == "dense":
    experts = functools.partial(moe_experts.dense_experts_reference, dtype=dtype)
  else:
    experts = functools.partial(moe_experts.dropless_experts, dtype=dtype, impl=impl)
  if mode == "fwd":
    return jax.jit(experts)
  loss = lambda *a: jnp.sum(experts(*a).astype(jnp.float32) * cot)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3, 4, 5)))


def _round_robin(cases: dict, args, reps: int, max_bytes: float) -> dict:
  """{name: (median seconds or skip message, planned bytes)}; one call per case per round."""
  compiled, out = {}, {}
  for name, fn in cases.items():
    c = fn.lower(*args).compile()
    nbytes = compiled_peak_bytes(c)
    skip = skip_message(nbytes, max_bytes)
    out[name] = (skip, nbytes)
    if skip is None:
      jax.block_until_ready(c(*args))  # warm-up
      compiled[name] = c
  times = {name: [] for name in compiled}
  for _ in range(reps):
    for name, c in compiled.items():
      t0 = time.perf_counter()
      jax.block_until_ready(c(*args))
      times[name].append(time.perf_counter() - t0)
  for name, ts in times.items():
    out[name] = (statistics.median(ts), out[name][1])
  return out


def _print_rows(label: str, mode: str, results: dict, base: str, ratios: dict, key: str) -> None:
  base_t = results[base][0]
  for impl, (t, nbytes) in results.items():
    timed = not isinstance(t, str)
    ms = f"{t * 1e3:.2f}" if timed else t
    sp = f"{base_t / t:.2f}x" if timed and not isinstance(base_t, str) else "-"
    print(f"| {label} | {mode} | {impl} | {ms} | {nbytes / 2 ** 20:.1f} | {sp} |", flush=True)
    if impl != base:
      ratios[f"{key}_{mode}_{impl}_vs_{base}"] = round(base_t / t, 3) if sp != "-" else ms


def run(a: argparse.Namespace) -> dict:
  """Prints the markdown table row by row; returns the speedup ratios."""
  max_bytes = a.max_gib * 2 ** 30
  print(f"MoE experts: tokens={a.tokens} d={a.d} f={a.f} experts={a.experts} top-k={a.topk} "
        f"reps={a.reps} backend={jax.default_backend()} max_gib={a.max_gib}\n")
  print("| case | mode | impl | median ms | peak MiB | vs baseline |\n|---|---|---|---|---|---|")
  ratios = {}
  impls = ("dense",) + tuple(a.impls.split(","))
  for dtype_name in a.dtypes.split(","):
    dtype = jnp.dtype(dtype_name)
    args, cot = _inputs(a.tokens, a.d, a.f, a.experts, a.topk, dtype)
    for mode in ("fwd", "fwd+bwd"):
      res = _round_robin({i: _fn(i, mode, dtype, cot) for i in impls}, args, a.reps, max_bytes)
      _print_rows(f"{dtype_name} train t={a.tokens}", mode, res, "dense", ratios, dtype_name)
      if "blocked" in res and "grouped" in res and not isinstance(res["grouped"][0], str):
        ratios[f"{dtype_name}_{mode}_grouped_vs_blocked"] = round(res["blocked"][0] / res["grouped"][0], 3)
    for t in DECODE_TOKENS:
      dargs, dcot = _inputs(t, a.d, a.f, a.experts, a.topk, dtype)
      res = _round_robin({i: _fn(i, "fwd", dtype, dcot) for i in DECODE_IMPLS}, dargs, a.reps * 5,
                         max_bytes)
      _print_rows(f"{dtype_name} decode t={t}", "fwd", res, "blocked", ratios, f"{dtype_name}_decode_t{t}")
      print(f"|  |  | auto picks | {moe_experts.resolve_impl('auto', t * a.topk, a.experts)} |  |  |")
  return ratios


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", choices=sorted(CONFIGS), default="e64k6", help="MoE sizes")
  p.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
  p.add_argument("--tokens", type=int, help="override the config's token count")
  p.add_argument("--impls", default="blocked,grouped",
                 help="dropless impls timed against dense (add ragged_dot to see XLA:CPU's masked dense)")
  p.add_argument("--reps", type=positive_int, default=3)
  p.add_argument("--dtypes", default="float32,bfloat16")
  # 8 GiB, not 16: XLA:CPU's resident memory ran above memory_analysis() here
  # (16.9 GB RSS for a 15.3 GiB case) on a 24 GiB machine shared with others.
  p.add_argument("--max_gib", type=float, default=8.0,
                 help="skip (do not run) cases whose compiled footprint exceeds this")
  a = p.parse_args()
  for name, value in CONFIGS[a.config].items():
    if getattr(a, name, None) is None:
      setattr(a, name, value)
  if a.quick:
    a.tokens, a.d, a.f = 512, 128, 64
  print(json.dumps(run(a)))


if __name__ == "__main__":
  main()
