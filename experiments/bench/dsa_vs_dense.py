"""DSA (indexer top-k + sparse attention) vs memory-efficient dense attention, fwd+bwd, long context.

Both sides are the attention core of a Gated DSA layer (MLA in absorbed form,
MQA over the latent + RoPE key; projections excluded, they cost the same on
both sides):

* dsa: the blockwise lightning-indexer top-k (no N x N matrix; forward only,
  the selection has no gradient), the sparse MQA over the selected keys
  (model/attention/sparse.py, custom VJP; fwd+bwd) and the sparse-stage
  indexer KL loss (fwd+bwd, gradients for the indexer's q, w, k), timed as
  three programs (each one's time is its own) and summed: the parts run one
  after the other in a training step, and three separate programs cost the
  long runs one top-k pass less.
* dense: flash-style causal MQA (model/attention/flash.py: online softmax,
  query blocks x causal key blocks, custom VJP), forward + backward.

The sparse attention's achieved FLOP/s counts only useful FLOPs: per
query, head and valid selected key, 2(c+p) for the logit and 2c for the
output in the forward, 3x that for fwd+bwd (the backward's four products;
the recomputed logits are not counted). A log-log fit of time vs N gives the
scaling exponent (1 = linear) of each part.

Dimensions: the `full` config's 128 heads and top-2048 at reduced width
(latent c = 64 instead of kv_lora 512, RoPE p = 32 instead of 64; indexer 16
heads x 64 instead of 64 x 128), batch 1, f32. Each program is compiled
ahead of time (not timed), its planned bytes read from XLA's memory_analysis,
and run only if they fit --mem_limit_gib.

Run (heavy, tens of minutes at 32K on 2 cores; never overlap with other heavy jobs):

    flock /tmp/horizon_heavy.lock python -m experiments.bench.dsa_vs_dense
    flock /tmp/horizon_heavy.lock python -m experiments.bench.dsa_vs_dense --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench.common import compiled_peak_bytes, positive_int, skip_message
from model.attention import sparse
from model.attention.flash import flash_mqa_attention

GIB = 2 ** 30


def make_inputs(args, n: int) -> dict:
  """Random f32 activations of one causal sequence of n tokens (attention and indexer)."""
  b, h, c, p, hi, di = 1, args.heads, args.latent, args.rope, args.index_heads, args.index_dim
  ks = jax.random.split(jax.random.key(n), 8)
  nrm = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(args.dtype)  # noqa: E731
  return {"attn": (nrm(ks[0], (b, n, h, c)), nrm(ks[1], (b, n, h, p)), nrm(ks[2], (b, n, c)),
                   nrm(ks[3], (b, n, p))),
          "index": (nrm(ks[4], (b, n, hi, di)), nrm(ks[5], (b, n, hi)), nrm(ks[6], (b, n, di))),
          "cot": nrm(ks[7], (b, n, h, c))}


def make_fns(args, n: int) -> dict:
  """{name: fn(inputs dict) -> outputs}: the programs that are compiled and timed."""
  scale = (args.latent + args.rope) ** -0.5
  topk, qb = min(args.topk, n), args.query_block
  seq = jnp.arange(n, dtype=jnp.int32)[None]
  seg = jnp.zeros((1, n), jnp.int32)

  def select(q_i, w_i, k_i):
    return sparse.blockwise_topk(q_i, w_i, k_i, seq, seg, seq, seg, topk, qb, args.key_block)

  def attn_loss(attn, idx, valid, cot):
    out, p_sel = sparse.sparse_mqa_attention(*attn, idx, valid, scale, qb)
    return jnp.sum(out.astype(jnp.float32) * cot), p_sel

  def kl_loss(index, p_sel, idx, valid):
    return sparse.indexer_kl(p_sel, sparse.selected_indexer_scores(*index, idx, qb), valid)

  def dense_loss(attn, cot):
    out = flash_mqa_attention(*attn, scale, args.flash_query_block, args.flash_key_block)
    return jnp.sum(out.astype(jnp.float32) * cot)

  return {"topk": lambda x: select(*x["index"]),
          "sparse_attn": lambda x: jax.grad(attn_loss, has_aux=True)(x["attn"], x["idx"], x["valid"],
                                                                     x["cot"]),
          "indexer_kl": lambda x: jax.grad(kl_loss)(x["index"], x["p_sel"], x["idx"], x["valid"]),
          "dense": lambda x: jax.grad(dense_loss)(x["attn"], x["cot"])}


def measure(fn, x, reps: int, limit_bytes: int) -> dict:
  """AOT compile (not timed), planned bytes, median time of reps runs (after one warm-up run when
  reps > 1) and the last run's outputs (the next part's inputs); skipped past the limit."""
  compiled = jax.jit(fn).lower(x).compile()
  peak = compiled_peak_bytes(compiled)
  skipped = skip_message(peak, limit_bytes)
  if skipped:
    return {"peak": peak, "skipped": skipped}
  times, outputs = [], compiled(x) if reps > 1 else None
  for _ in range(reps):
    t0 = time.perf_counter()
    outputs = jax.block_until_ready(compiled(x))
    times.append(time.perf_counter() - t0)
  return {"peak": peak, "time": statistics.median(times), "outputs": outputs}


def useful_attn_flops(args, n: int) -> float:
  """fwd+bwd FLOPs of the sparse attention over the valid selected keys only."""
  pairs = float(np.minimum(np.arange(1, n + 1), args.topk).sum())
  return 3 * pairs * args.heads * (2 * (args.latent + args.rope) + 2 * args.latent)


def _row(n, name, r, extra=""):
  t = f"{r['time']:.2f}" if "time" in r else r["skipped"]
  print(f"| {n:>6} | {name:<17} | {t:>24} | {r['peak'] / GIB:>8.2f} | {extra:<28} |", flush=True)


def bench_length(args, n: int, limit: int) -> dict:
  x = make_inputs(args, n)
  fns = make_fns(args, n)
  reps = args.reps if n <= args.reps_max_n else 1
  res = {"topk": measure(fns["topk"], x, reps, limit)}
  _row(n, "dsa top-k (fwd)", res["topk"])
  x["idx"], x["valid"] = res["topk"].pop("outputs", None) or jax.jit(fns["topk"])(x)
  res["sparse_attn"] = measure(fns["sparse_attn"], x, reps, limit)
  sa = res["sparse_attn"]
  gfs = useful_attn_flops(args, n) / sa["time"] / 1e9 if "time" in sa else None
  _row(n, "sparse attn f+b", res["sparse_attn"], f"{gfs:.1f} useful GFLOP/s" if gfs else "")
  x["p_sel"] = (res["sparse_attn"].pop("outputs", None) or jax.jit(fns["sparse_attn"])(x))[1]
  res["indexer_kl"] = measure(fns["indexer_kl"], x, reps, limit)
  _row(n, "indexer KL f+b", res["indexer_kl"])
  parts = [res[k] for k in ("topk", "sparse_attn", "indexer_kl")]
  res["dsa"] = {"peak": max(r["peak"] for r in parts)}
  if all("time" in r for r in parts):
    res["dsa"]["time"] = sum(r["time"] for r in parts)
  else:
    res["dsa"]["skipped"] = "a part was skipped"
  _row(n, "dsa total f+b", res["dsa"], "sum of the three parts above")
  res["indexer_kl"].pop("outputs", None)
  res["dense"] = measure(fns["dense"], x, reps, limit)
  res["dense"].pop("outputs", None)
  both = "time" in res["dense"] and "time" in res["dsa"]
  ratio = res["dense"]["time"] / res["dsa"]["time"] if both else None
  _row(n, "dense flash f+b", res["dense"],
       f"dense/dsa {ratio:.2f} (limit {n / (2 * args.topk):.1f})" if ratio else "")
  out = {name: {"s": r.get("time"), "peak_bytes": r["peak"], "skipped": r.get("skipped")}
         for name, r in res.items()}
  out["sparse_attn"]["useful_gflop_per_s"] = gfs
  out["ratio_dense_over_dsa"] = ratio
  out["ratio_limit_N_over_2k"] = n / (2 * args.topk)
  return out


def plan_length(args, n: int) -> dict:
  """Planned bytes (XLA memory_analysis) of every program at length n, compiled from abstract inputs."""
  x = jax.eval_shape(lambda: make_inputs(args, n))
  topk = min(args.topk, n)
  x["idx"] = jax.ShapeDtypeStruct((1, n, topk), jnp.int32)
  x["valid"] = jax.ShapeDtypeStruct((1, n, topk), jnp.bool_)
  x["p_sel"] = jax.ShapeDtypeStruct((1, n, topk), jnp.float32)
  out = {}
  for name, fn in make_fns(args, n).items():
    out[name] = compiled_peak_bytes(jax.jit(fn).lower(x).compile())
    print(f"| {n:>6} | {name:<17} | {'planned only':>24} | {out[name] / GIB:>8.2f} | {'':<28} |", flush=True)
  return out


def scaling_fit(ns, per_n: dict) -> dict:
  """Exponent a of time ~ N^a (least squares in log-log) per part, over the lengths that ran."""
  fit = {}
  for name in ("topk", "sparse_attn", "indexer_kl", "dsa", "dense"):
    pts = [(n, per_n[n][name]["s"]) for n in ns if per_n[n][name]["s"]]
    if len(pts) >= 2:
      fit[name] = round(float(np.polyfit(np.log([p[0] for p in pts]), np.log([p[1] for p in pts]), 1)[0]), 3)
  return fit


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="short lengths and top-k (a smoke run)")
  ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
  ap.add_argument("--heads", type=int, default=128)
  ap.add_argument("--latent", type=int, default=64)
  ap.add_argument("--rope", type=int, default=32)
  ap.add_argument("--index_heads", type=int, default=16)
  ap.add_argument("--index_dim", type=int, default=64)
  ap.add_argument("--topk", type=int, default=2048)
  ap.add_argument("--query_block", type=int, default=16, help="DSA top-k and sparse attention")
  ap.add_argument("--key_block", type=int, default=2048, help="DSA top-k")
  ap.add_argument("--flash_query_block", type=int, default=64)
  ap.add_argument("--flash_key_block", type=int, default=512)
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  ap.add_argument("--reps", type=positive_int, default=3, help="timed runs (median) per program ...")
  ap.add_argument("--reps_max_n", type=int, default=4096, help="... up to this N; longer ones run once")
  ap.add_argument("--mem_limit_gib", type=float, default=12.0)
  ap.add_argument("--plan_only", action="store_true", help="only compile and print each program's bytes")
  args = ap.parse_args()
  if args.quick:
    args.lengths, args.topk, args.heads, args.key_block = [512, 1024], 128, 16, 256
  print(f"backend={jax.default_backend()} dtype={args.dtype} b=1 heads={args.heads} latent={args.latent} "
        f"rope={args.rope} index_heads={args.index_heads} index_dim={args.index_dim} topk={args.topk} "
        f"dsa blocks q={args.query_block} k={args.key_block}; flash blocks q={args.flash_query_block} "
        f"k={args.flash_key_block}; reps={args.reps} (median) for N<={args.reps_max_n}, else 1; "
        "compile excluded (ahead-of-time)")
  print(f"| {'N':>6} | {'part':<17} | {'time_s':>24} | {'peak_GiB':>8} | {'note':<28} |")
  print(f"|{'-' * 8}|{'-' * 19}|{'-' * 26}|{'-' * 10}|{'-' * 30}|")
  t0 = time.perf_counter()
  limit = int(args.mem_limit_gib * GIB)
  if args.plan_only:
    print(json.dumps({"planned_bytes": {str(n): plan_length(args, n) for n in args.lengths}}))
    return
  per_n = {n: bench_length(args, n, limit) for n in args.lengths}
  fit = scaling_fit(args.lengths, per_n)
  print(f"time ~ N^a, fitted a: {fit}")
  result = {"config": {k: getattr(args, k) for k in ("heads", "latent", "rope", "index_heads", "index_dim",
                                                     "topk", "query_block", "key_block", "flash_query_block",
                                                     "flash_key_block", "dtype")},
            "results": {str(n): r for n, r in per_n.items()}, "time_exponent": fit,
            "ratio_dense_over_dsa": {str(n): per_n[n]["ratio_dense_over_dsa"] for n in args.lengths},
            "wall_s": round(time.perf_counter() - t0, 1)}
  print(json.dumps(result))


if __name__ == "__main__":
  main()
