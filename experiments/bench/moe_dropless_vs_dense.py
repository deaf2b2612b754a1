"""Dropless grouped-matmul experts vs running every expert on every token.

Run (under the heavy-job lock on shared machines):

    flock /tmp/horizon_heavy.lock python -m experiments.bench.moe_dropless_vs_dense
    python -m experiments.bench.moe_dropless_vs_dense --quick

Times `model.moe_experts.dropless_experts` (impl 'ragged_dot' and 'blocked') against
`model.moe_experts.dense_experts_reference` on the same random routing, jitted, forward
and forward+backward, in f32 and bf16 compute. Warm-up (compile + first run) is
excluded; the median of --reps runs is reported. Peak memory is XLA's
`memory_analysis()` (temp + arguments + outputs) of the compiled function; a
case above --max_gib is reported as skipped, not run. The last line is a JSON
object: dense time / dropless time per case (> 1 means dropless is faster).
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp

from experiments.bench.common import compiled_peak_bytes, median_seconds
from model import moe_experts

IMPLS = ("dense", "ragged_dot", "blocked")


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


def _measure(fn, args, reps: int, max_bytes: float):
  """(median seconds or None, bytes) for a jitted fn; None when over max_bytes."""
  compiled = fn.lower(*args).compile()
  nbytes = compiled_peak_bytes(compiled)
  if nbytes > max_bytes:
    return None, nbytes
  return median_seconds(compiled, args, reps), nbytes


def run(a: argparse.Namespace) -> dict:
  """Prints one table row per case as it finishes; returns the speedup ratios."""
  max_bytes = a.max_gib * 2 ** 30
  print(f"MoE experts: tokens={a.tokens} d={a.d} f={a.f} experts={a.experts} top-k={a.topk} "
        f"reps={a.reps} backend={jax.default_backend()} "
        f"block={moe_experts.default_block(a.tokens * a.topk, a.experts)} max_gib={a.max_gib}")
  print(f"{'dtype':<9} {'mode':<8} {'impl':<11} {'median ms':>11} {'peak MiB':>10} {'vs dense':>9}",
        flush=True)
  ratios = {}
  for dtype_name in a.dtypes.split(","):
    dtype = jnp.dtype(dtype_name)
    args, cot = _inputs(a.tokens, a.d, a.f, a.experts, a.topk, dtype)
    for mode in ("fwd", "fwd+bwd"):
      dense_t = None
      for impl in IMPLS:  # dense first: the others are compared with it
        t, nbytes = _measure(_fn(impl, mode, dtype, cot), args, a.reps, max_bytes)
        dense_t = t if impl == "dense" else dense_t
        speedup = dense_t / t if (t and dense_t) else None
        if impl != "dense":
          ratios[f"{dtype_name}_{mode}_{impl}_speedup_vs_dense"] = (
              round(speedup, 3) if speedup else f"skipped: needs {nbytes / 2 ** 30:.1f} GiB")
        ms = f"{t * 1e3:.1f}" if t else f"skipped: needs {nbytes / 2 ** 30:.1f} GiB"
        sp = f"{speedup:.2f}x" if speedup else "-"
        print(f"{dtype_name:<9} {mode:<8} {impl:<11} {ms:>11} {nbytes / 2 ** 20:>10.1f} {sp:>9}",
              flush=True)
  return ratios


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
  p.add_argument("--tokens", type=int, default=4096)
  p.add_argument("--d", type=int, default=512)
  p.add_argument("--f", type=int, default=256)
  p.add_argument("--experts", type=int, default=64)
  p.add_argument("--topk", type=int, default=6)
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--dtypes", default="float32,bfloat16")
  # 8 GiB, not 16: XLA:CPU's resident memory ran above memory_analysis() here
  # (16.9 GB RSS for a 15.3 GiB case) on a 24 GiB machine shared with others.
  p.add_argument("--max_gib", type=float, default=8.0,
                 help="skip (do not run) cases whose compiled footprint exceeds this")
  a = p.parse_args()
  if a.quick:
    a.tokens, a.d, a.f = 512, 128, 64
  ratios = run(a)
  print(json.dumps(ratios))


if __name__ == "__main__":
  main()
