"""Gated DSA (gather-based, blockwise top-k) vs the same layer computed densely.

The dense path is what public JAX codebases do for DeepSeek sparse attention:
the full N x N indexer score matrix, top-k per row, an N x N mask, and dense
MLA attention under that mask. Both paths compute the same function (same
parameters, same top-k set, same indexer KL loss); we compare time and the
peak memory XLA plans for the compiled program (memory_analysis: temp +
arguments + outputs), forward and forward+backward. A dense config that would
need more than --mem_limit_gib is reported as skipped with the bytes it needs.
Then the DSA layer alone at long contexts, with the dense path's requirement
from its compiled (never run) program.

Dimensions: the `full` Gated DSA with d_model and head counts divided by
--head_divisor (q_lora_rank too), per-head dims kept (qk_nope 128, qk_rope 64,
v 128, kv_lora 512, index_head_dim 128), index_topk 2048.

Run (heavy; never overlap with other heavy jobs):

    flock /tmp/horizon_heavy.lock python -m experiments.bench.dsa_vs_dense
    flock /tmp/horizon_heavy.lock python -m experiments.bench.dsa_vs_dense --quick
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx

from configs import horizon
from experiments.bench.common import compiled_peak_bytes, median_seconds, skip_message
from model.attention import sparse
from model.attention.dsa import GatedDSA
from model.config import ModelConfig
from pallas_kernels.indexer_topk.reference import allowed_mask, indexer_scores_dense
from pallas_kernels.sparse_attention.reference import dense_mqa_attention

GIB = 2 ** 30


def bench_config(args) -> ModelConfig:
  """The `full` Gated DSA with d_model, head counts and q_lora scaled down."""
  full = ModelConfig.from_config(horizon.get_config("full").model)
  div = args.head_divisor
  return full.replace(d_model=full.d_model // div, num_heads=full.num_heads // div,
                      q_lora_rank=full.q_lora_rank // div, index_heads=full.index_heads // div,
                      index_topk=args.topk, dsa_query_block=args.query_block,
                      dsa_key_block=args.key_block, dtype=args.dtype, param_dtype="float32",
                      indexer_stage="sparse")


def dense_topk_layer(layer: GatedDSA, x, positions, segment_ids):
  """The layer computed densely: N x N indexer scores, top-k, N x N mask, dense MLA."""
  cfg = layer.cfg
  c_q, q_lat, q_rope, latent, k_rope = layer.mla_projections(x, positions)
  q_i, w_i, k_i = layer.indexer_projections(x, c_q, positions)
  b, t = segment_ids.shape
  seq = jnp.broadcast_to(jnp.arange(t), (b, t))
  allowed = allowed_mask(seq, segment_ids, seq, segment_ids)
  scores = indexer_scores_dense(q_i, w_i, k_i)
  vals, ids = jax.lax.top_k(jax.lax.stop_gradient(jnp.where(allowed, scores, -jnp.inf)),
                            min(cfg.index_topk, t))
  rows = (jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], ids)
  mask = jnp.zeros((b, t, t), bool).at[rows].set(vals > -jnp.inf)
  out_lat, p = dense_mqa_attention(q_lat, q_rope, latent, k_rope, mask, layer.scale)
  return layer.output_projection(out_lat, x), sparse.indexer_kl(p, scores, mask)


def make_fns(layer: GatedDSA, dense: bool):
  """Forward and forward+backward (grads wrt params and x) as pure functions of (params, x)."""
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def fwd(ps, x):
    b, t, _ = x.shape
    pos, seg = jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.zeros((b, t), jnp.int32)
    m = nnx.merge(graphdef, ps, rest)
    if dense:
      return dense_topk_layer(m, x, pos, seg)
    y, aux = m(x, pos, seg)
    return y, aux["indexer_loss"]

  def fwdbwd(ps, x):
    def loss(ps, x):
      y, il = fwd(ps, x)
      return jnp.mean(jnp.square(y.astype(jnp.float32))) + il
    return jax.grad(loss, (0, 1))(ps, x)

  return params, {"fwd": fwd, "fwd+bwd": fwdbwd}


def measure(fn, params, x, reps: int, limit_bytes: int, run: bool = True) -> dict:
  """Compiles ahead of time (excluded from timing), reads planned memory, times `reps` runs."""
  compiled = jax.jit(fn).lower(params, x).compile()
  peak = compiled_peak_bytes(compiled)
  skipped = skip_message(peak, limit_bytes)
  if skipped:
    return {"peak": peak, "skipped": skipped}
  if not run:
    return {"peak": peak, "skipped": "not run"}
  return {"peak": peak, "time": median_seconds(compiled, (params, x), reps, warmup=False)}


def _row(n, path, mode, r, ratio="", limit=""):
  t = f"{r['time']:.3f}" if "time" in r else r["skipped"]
  print(f"{n:>7} | {path:<5} | {mode:<7} | {t:>24} | {r['peak'] / GIB:>9.3f} | {ratio:>6} | {limit:>6}",
        flush=True)


def compare(cfg, layer_d, layer_s, x_of, args, limit) -> dict:
  """DSA vs dense at the comparison lengths; returns the ratios."""
  out = {}
  fns = {"dsa": make_fns(layer_s, dense=False), "dense": make_fns(layer_d, dense=True)}
  for n in args.compare:
    x = x_of(n)
    for mode in ("fwd", "fwd+bwd"):
      res = {}
      for path in ("dsa", "dense"):
        params, f = fns[path]
        res[path] = measure(f[mode], params, x, args.reps if n <= args.reps_max_n else 1, limit)
      lim = n / (2 * cfg.index_topk)
      ratio = res["dense"]["time"] / res["dsa"]["time"] if "time" in res["dense"] else None
      _row(n, "dsa", mode, res["dsa"])
      _row(n, "dense", mode, res["dense"], f"{ratio:.2f}" if ratio else "-", f"{lim:.2f}")
      out[f"{mode}@{n}"] = {
          "time_ratio_dense_over_dsa": ratio, "ratio_limit_N_over_2k": lim,
          "dsa_s": res["dsa"].get("time"), "dense_s": res["dense"].get("time"),
          "dsa_peak_bytes": res["dsa"]["peak"], "dense_peak_bytes": res["dense"]["peak"],
          "mem_ratio_dense_over_dsa": res["dense"]["peak"] / res["dsa"]["peak"]}
  return out


def long_context(layer_d, layer_s, x_of, args, limit) -> dict:
  """DSA alone at long contexts; the dense program is compiled for its bytes, never run."""
  out = {}
  fns_s, fns_d = make_fns(layer_s, dense=False), make_fns(layer_d, dense=True)
  for n in args.long:
    x = x_of(n)
    modes = ("fwd", "fwd+bwd") if n in args.long_fwdbwd else ("fwd",)
    for mode in modes:
      r = measure(fns_s[1][mode], fns_s[0], x, 1, limit)
      d = measure(fns_d[1][mode], fns_d[0], x, 1, limit, run=False)
      _row(n, "dsa", mode, r)
      _row(n, "dense", mode, {"peak": d["peak"], "skipped": "compiled only, not run"})
      out[f"{mode}@{n}"] = {"dsa_s": r.get("time"), "dsa_peak_bytes": r["peak"],
                            "dense_required_bytes": d["peak"]}
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="small N and top-k (a smoke run)")
  ap.add_argument("--head_divisor", type=int, default=16)
  ap.add_argument("--topk", type=int, default=2048)
  ap.add_argument("--query_block", type=int, default=16)
  ap.add_argument("--key_block", type=int, default=32768)
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                  help="compute dtype (XLA:CPU runs this layer's f32 path faster than bf16)")
  ap.add_argument("--reps", type=int, default=2, help="timed runs (median) per compared config ...")
  ap.add_argument("--reps_max_n", type=int, default=8192, help="... up to this N; longer ones run once")
  ap.add_argument("--compare", type=int, nargs="+", default=[4096, 8192, 16384])
  ap.add_argument("--long", type=int, nargs="+", default=[32768, 65536, 131072])
  ap.add_argument("--long_fwdbwd", type=int, nargs="*", default=[],
                  help="long lengths that also time fwd+bwd (others: forward only)")
  ap.add_argument("--mem_limit_gib", type=float, default=16.0)
  args = ap.parse_args()
  if args.quick:
    args.topk, args.compare, args.long, args.long_fwdbwd = 256, [1024, 2048], [4096, 8192], [4096]
    args.key_block, args.reps_max_n = 1024, 2048
  cfg = bench_config(args)
  layer_s = GatedDSA(cfg, rngs=nnx.Rngs(0))
  layer_d = layer_s  # same parameters: both paths compute the same function
  x_of = lambda n: jax.random.normal(jax.random.key(n), (1, n, cfg.d_model), jnp.float32)
  limit = int(args.mem_limit_gib * GIB)
  print(f"backend={jax.default_backend()} devices={jax.device_count()} dtype={cfg.dtype} b=1 "
        f"d_model={cfg.d_model} heads={cfg.num_heads} q_lora={cfg.q_lora_rank} "
        f"kv_lora={cfg.kv_lora_rank} qk_nope={cfg.qk_nope_dim} qk_rope={cfg.qk_rope_dim} "
        f"v={cfg.v_head_dim} index_heads={cfg.index_heads} index_dim={cfg.index_head_dim} "
        f"topk={cfg.index_topk} query_block={cfg.dsa_query_block} key_block={cfg.dsa_key_block} "
        f"reps={args.reps} for N<={args.reps_max_n}, else 1; compile excluded (ahead-of-time); "
        f"long: {'fwd+bwd at ' + str(args.long_fwdbwd) if args.long_fwdbwd else 'forward only'}")
  print(f"{'N':>7} | {'path':<5} | {'mode':<7} | {'time_s':>24} | {'peak_GiB':>9} | {'ratio':>6} | "
        f"{'N/(2k)':>6}")
  t0 = time.perf_counter()
  result = {"config": {"d_model": cfg.d_model, "heads": cfg.num_heads, "q_lora": cfg.q_lora_rank,
                       "index_heads": cfg.index_heads, "topk": cfg.index_topk, "dtype": cfg.dtype,
                       "query_block": cfg.dsa_query_block, "key_block": cfg.dsa_key_block}}
  result["compare"] = compare(cfg, layer_d, layer_s, x_of, args, limit)
  result["long"] = long_context(layer_d, layer_s, x_of, args, limit)
  result["wall_s"] = round(time.perf_counter() - t0, 1)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
