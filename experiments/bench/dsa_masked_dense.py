"""Benchmark: a Gated DSA layer's sparse stage gathered vs dense under its top-k mask, fwd+bwd.

`config.model.dsa_dense_len` picks, for full-sequence calls (training, SFT, RL scoring), between
two computations of the same function (tests/test_dsa.py checks them equal, forward and
gradients):

* gather (t > dsa_dense_len): the blockwise top-k (lax.top_k merges per key block), then sparse
  MQA that gathers each query's top-k [latent | k_rope] rows, and the indexer KL over the
  gathered keys' scores (model/attention/sparse.py);
* masked dense (t <= dsa_dense_len): the dense indexer scores, the top-k set as a [t, s] mask
  found by bisection (sparse.topk_mask), one dense MQA under it, and the KL over the mask.

Each side is the whole layer (`GatedDSA.__call__`: projections, attention, gate, output, the
indexer loss) differentiated like the train step: grad of sum(y * ct) + indexer_loss with respect
to the layer's parameters and x. Tokens per call are fixed (--tokens), so longer rows mean fewer
of them; the two sides run interleaved, --reps each, median wall time.

    python -m experiments.bench.dsa_masked_dense                 # agent config, 1K-4K rows
    python -m experiments.bench.dsa_masked_dense --quick         # tiny config (seconds)
    python -m experiments.bench.dsa_masked_dense --variant small --lengths 512 1024

Prints a table and, as the last line, one JSON object with the gather/masked ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import horizon
from experiments.bench.common import positive_int
from model.attention.dsa import GatedDSA
from model.config import ModelConfig


def _grad_fn(cfg: ModelConfig):
  """jit(grad of sum(y * ct) + indexer loss wrt (params, x)) for a fresh layer; its params."""
  graphdef, params, rest = nnx.split(GatedDSA(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)

  def loss(p, x, pos, seg, ct):
    y, aux = nnx.merge(graphdef, p, rest)(x, pos, seg)
    return jnp.sum(y.astype(jnp.float32) * ct) + aux["indexer_loss"]
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params


def _inputs(cfg: ModelConfig, b: int, t: int, seed: int = 0):
  """x, positions, packed segment ids (3 segments per row at random cuts), cotangent."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((b, t, cfg.d_model)), cfg.jnp_dtype)
  seg = np.zeros((b, t), np.int32)
  for r in range(b):
    for cut in sorted(rng.choice(np.arange(t // 8, t), 2, replace=False)):
      seg[r, cut:] += 1
  pos = np.zeros((b, t), np.int32)
  for r in range(b):
    for i in range(1, t):
      pos[r, i] = 0 if seg[r, i] != seg[r, i - 1] else pos[r, i - 1] + 1
  ct = jnp.asarray(rng.standard_normal((b, t, cfg.d_model)) / np.sqrt(b * t), jnp.float32)
  return x, jnp.asarray(pos), jnp.asarray(seg), ct


def bench_length(cfg: ModelConfig, tokens: int, t: int, reps: int) -> dict:
  b = max(1, tokens // t)
  args = _inputs(cfg, b, t)
  sides = {}
  for name, dense_len in (("gather", 0), ("masked", t)):
    fn, params = _grad_fn(cfg.replace(dsa_dense_len=dense_len))
    out = jax.block_until_ready(fn(params, *args))  # compile; kept to compare the sides
    sides[name] = {"fn": fn, "params": params, "out": out, "s": []}
  for _ in range(reps):
    for side in sides.values():
      t0 = time.perf_counter()
      jax.block_until_ready(side["fn"](side["params"], *args))
      side["s"].append(time.perf_counter() - t0)
  (v_g, (gp_g, gx_g)), (v_m, (gp_m, gx_m)) = sides["gather"]["out"], sides["masked"]["out"]
  leaves = zip(jax.tree.leaves((gp_g, gx_g)), jax.tree.leaves((gp_m, gx_m)), strict=True)
  rel = max(float(jnp.max(jnp.abs(a - m)) / (jnp.max(jnp.abs(a)) + 1e-30)) for a, m in leaves)
  g_ms, m_ms = (1e3 * statistics.median(sides[k]["s"]) for k in ("gather", "masked"))
  return {"t": t, "batch": b, "gather_ms": g_ms, "masked_ms": m_ms, "ratio": g_ms / m_ms,
          "loss_rel_diff": abs(float(v_g) - float(v_m)) / abs(float(v_g)), "grad_rel_diff": rel}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--variant", default="agent", choices=("agent", "small"))
  p.add_argument("--quick", action="store_true", help="tiny config, 2 x 64 tokens")
  p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
  p.add_argument("--tokens", type=int, default=8192, help="tokens per call (rows = tokens / length)")
  p.add_argument("--reps", type=positive_int, default=3)
  a = p.parse_args()
  variant = "tiny" if a.quick else a.variant
  cfg = ModelConfig.from_config(horizon.get_config(variant).model).replace(remat="none")
  lengths, tokens = ([32, 64], 128) if a.quick else (a.lengths, a.tokens)
  for t in lengths:
    if t <= cfg.index_topk:
      raise SystemExit(f"--lengths: {t} <= index_topk={cfg.index_topk} takes the plain dense path; "
                       "give lengths above it.")
  print(f"config {variant} (index_topk {cfg.index_topk}, {cfg.num_heads} heads, latent "
        f"{cfg.kv_lora_rank}+{cfg.qk_rope_dim}, dtype {cfg.dtype}), {tokens} tokens per call, "
        f"backend {jax.default_backend()}, median of {a.reps}")
  print(f"{'t':>6} {'rows':>5} {'gather ms':>10} {'masked ms':>10} {'gather/masked':>14} "
        f"{'loss rel diff':>14} {'grad rel diff':>14}")
  rows = []
  for t in lengths:
    r = bench_length(cfg, tokens, t, a.reps)
    rows.append(r)
    print(f"{t:>6} {r['batch']:>5} {r['gather_ms']:>10.1f} {r['masked_ms']:>10.1f} {r['ratio']:>13.2f}x "
          f"{r['loss_rel_diff']:>14.2e} {r['grad_rel_diff']:>14.2e}", flush=True)
  print(json.dumps({"variant": variant, "tokens": tokens, "dsa_dense_len": cfg.dsa_dense_len,
                    "ratio_gather_over_masked": {str(r["t"]): round(r["ratio"], 3) for r in rows},
                    "ms": {str(r["t"]): {k: round(r[f"{k}_ms"], 1) for k in ("gather", "masked")}
                           for r in rows}}))


if __name__ == "__main__":
  main()
