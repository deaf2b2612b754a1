"""Where a train step's time goes (`small`, or --variant): each part's fwd + bwd alone, against the step.

    python -m experiments.bench.train_step_parts            # small, 8 x 256 tokens
    python -m experiments.bench.train_step_parts --quick    # tiny, 2 x 64 (seconds)

In one process: the bf16 peak (`training.metrics.measure_peak_flops`, best over --peak_n sizes);
the whole train step (`training.train_step.train_step` jitted as the trainer does, remat none,
backward products in the compute dtype) and the same step with a plain SGD update (behind the
same non-finite skip) in place of `make_optimizer`'s clipping, AdamW and leaf groups, timed
alternately; then each part of the model on the
step's activations ([b, t, d] in the compute dtype, random), jitted as `jax.grad` of
sum(output x a random cotangent) + the part's auxiliary losses, with respect to the part's
parameters and its input -- the work the part adds to the step:

  attention (one per layer kind): `Block.attn(attn_norm(x))` (DSA: MLA projections, indexer,
  top-k, sparse attention, the indexer's KL loss; delta: projections, conv, the chunked rule);
  FFN (dense / MoE): `Block._ffn(x)` (norm, router, routed and shared experts, the residual);
  LM head: final norm, logits and the cross-entropy against random targets;
  optimizer: the step minus the SGD step, i.e. clipping + AdamW beyond SGD, timed inside the
  step (an elementwise update over every parameter timed alone ran 3-4x slower here with its
  buffers donated, as the step's are, than without; the whole step showed no such difference).

A part's time is the median of --reps calls, times the layers it occurs in. What the parts do
not cover ("rest": the SGD update, the embedding gather, residual glue, the loss's reductions and
the step's metrics, and whatever XLA gains or loses by compiling the parts together) is the SGD
step minus their sum (at --quick's millisecond parts, timing noise can make it negative).
Achieved FLOP/s per part = 3 x its forward FLOPs (`model.flops.flops_per_token`) x tokens / its
time. The last line is a JSON object with each part's share of the step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from configs import horizon
from experiments.bench.common import best_peak_flops, matmul_sizes, median_seconds, positive_int, report_cpu
from experiments.bench.train_step import _batch
from model import flops
from model.config import ModelConfig
from model.decoder import Horizon
from training import leaf_groups
from training.train_step import TrainConfig, make_optimizer, token_cross_entropy, train_step

# Forward FLOP components of model.flops per part (divided by the layers the part occurs in).
_FLOPS = {"dsa": ("dsa_projections", "indexer_projections", "dsa_attention", "indexer_scores",
                  "indexer_selected"),
          "delta": ("delta_projections", "delta_chunk"), "dense": ("dense_ffn",),
          "moe": ("router", "routed_experts", "shared_experts"), "head": ("lm_head",)}


def _median_seconds(fn: Callable, args: tuple, reps: int) -> float:
  jax.block_until_ready(fn(*args))  # compile
  return median_seconds(fn, args, reps)  # after a warm-up call


def _scalar_aux(aux: dict) -> jax.Array:
  """The auxiliary losses a part returns (float scalars), summed: their backward is part of the step."""
  return sum((v.astype(jnp.float32) for v in aux.values()
              if jnp.ndim(v) == 0 and jnp.issubdtype(v.dtype, jnp.floating)), jnp.float32(0.0))


def _part_grad(module: nnx.Module, call: Callable, *names: str) -> tuple[Callable, object]:
  """(jit(grad of sum(call(module, x)[0] * ct) + aux wrt (params, x)), params): the parameters under
  the submodules `names` (all of the module's without names)."""
  where = nnx.All(nnx.Param, nnx.Any(*map(nnx.PathContains, names))) if names else nnx.Param
  graphdef, params, rest = nnx.split(module, where, ...)

  def loss(p, x, ct):
    y, aux = call(nnx.merge(graphdef, p, rest), x)
    return jnp.sum(y.astype(jnp.float32) * ct) + _scalar_aux(aux)
  return jax.jit(jax.grad(loss, argnums=(0, 1))), params


class _Head(nnx.Module):
  """The model's final norm and LM head (Horizon.logits on them alone)."""

  def __init__(self, model: Horizon):
    self.cfg, self.final_norm, self.head = model.cfg, model.final_norm, model.head

  logits = Horizon.logits


def _parts(model: Horizon, b: int, t: int, seed: int = 0) -> list[tuple[str, str, int, Callable, tuple]]:
  """(name, flops key, layers, jitted fn, args) for each part of the step."""
  cfg = model.cfg
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((b, t, cfg.d_model)), cfg.jnp_dtype)
  ct = jnp.asarray(rng.standard_normal((b, t, cfg.d_model)) / np.sqrt(b * t), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  segments = jnp.ones((b, t), jnp.int32)
  out = []
  for kind in ("dsa", "delta"):
    layers = [blk for blk in model.blocks if blk.kind == kind]
    if layers:
      fn, params = _part_grad(layers[0], lambda m, h: m.attn(m.attn_norm(h), positions, segments),
                              "attn_norm", "attn")
      out.append((f"{kind} attention", kind, len(layers), fn, (params, x, ct)))
  for kind in ("dense", "moe"):
    layers = [blk for blk in model.blocks if blk.ffn_kind == kind]
    if layers:
      fn, params = _part_grad(layers[0], lambda m, h: m._ffn(h), "ffn_norm", "ffn")
      out.append((f"{kind} FFN", kind, len(layers), fn, (params, x, ct)))
  targets = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)

  def head_call(m, h):
    ce, n = token_cross_entropy(m.logits(h), targets, jnp.ones((b, t), jnp.float32))
    return ce / n, {}
  fn, params = _part_grad(_Head(model), head_call)
  out.append(("LM head + loss", "head", 1, fn, (params, x, jnp.float32(1.0))))
  return out


def _step_and_sgd_step(cfg: ModelConfig, tc: TrainConfig, batch, reps: int) -> tuple[float, float]:
  """Median seconds of the train step and of the same step with optax.sgd, timed alternately."""
  runs = []
  sgd = leaf_groups.apply_if_finite(optax.sgd(1e-4), 1 << 30)  # the step reads its counts
  for tx in (make_optimizer(tc), sgd):
    model = Horizon(cfg, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = nnx.jit(train_step, static_argnames=("tc",), donate_argnums=(0, 1))
    for _ in range(2):  # compile, warm up
      jax.block_until_ready(step(model, optimizer, batch, tc))
    runs.append((step, model, optimizer, []))
  for _ in range(reps):
    for step, model, optimizer, times in runs:
      t0 = time.perf_counter()
      jax.block_until_ready(step(model, optimizer, batch, tc))
      times.append(time.perf_counter() - t0)
  return statistics.median(runs[0][3]), statistics.median(runs[1][3])


def run(a: argparse.Namespace) -> dict:
  variant = "tiny" if a.quick else a.variant
  config = horizon.get_config(variant)
  cfg = ModelConfig.from_config(config.model).replace(remat="none")
  tc = TrainConfig.from_config(config.train)
  tc = dataclasses.replace(tc, global_batch=a.batch or (2 if a.quick else tc.global_batch),
                           seq_len=a.seq_len or (64 if a.quick else tc.seq_len))
  b, t = tc.global_batch, tc.seq_len
  peak, _ = best_peak_flops([1024] if a.quick else a.peak_n, max(a.reps, 10))
  step, sgd_step = _step_and_sgd_step(cfg, tc, _batch(b, t), a.reps)
  model = Horizon(cfg, rngs=nnx.Rngs(0))
  per_token = flops.flops_per_token(cfg, t)
  n_kind = {"dsa": cfg.layer_kinds.count("dsa"), "delta": cfg.layer_kinds.count("delta"),
            "dense": cfg.ffn_kinds.count("dense"), "moe": cfg.ffn_kinds.count("moe"), "head": 1}
  rows = []
  for name, key, layers, fn, args in _parts(model, b, t):
    s = _median_seconds(fn, args, a.reps)
    train_flops = 3 * sum(per_token[c] for c in _FLOPS[key]) / n_kind[key] * b * t  # one layer
    rows.append({"part": name, "layers": layers, "ms_each": 1e3 * s, "ms": 1e3 * s * layers,
                 "gflops": train_flops / s / 1e9})
  rows.append({"part": "optimizer (step - SGD step)", "layers": 1, "ms_each": None,
               "ms": 1e3 * (step - sgd_step), "gflops": None})
  rows.append({"part": "rest (SGD step - parts)", "layers": None, "ms_each": None,
               "ms": 1e3 * sgd_step - sum(r["ms"] for r in rows[:-1]), "gflops": None})
  cpu = report_cpu()
  print(f"config {variant}, {b} x {t} tokens, remat none, "
        f"backend {jax.default_backend()}; peak (bf16 x bf16 -> f32 matmul, measured here) "
        f"{peak / 1e9:.1f} GFLOP/s; train step "
        f"{1e3 * step:.1f} ms ({3 * per_token['forward'] * b * t / step / peak:.1%} MFU)")
  print(f"{'part':<27} {'layers':>6} {'ms each':>8} {'ms':>8} {'% step':>7} {'GFLOP/s':>8} {'of peak':>8}")
  for r in rows:
    each = "" if r["ms_each"] is None else f"{r['ms_each']:.1f}"
    rate = "" if r["gflops"] is None else f"{r['gflops']:.1f}"
    frac = "" if r["gflops"] is None else f"{100 * r['gflops'] * 1e9 / peak:.1f}%"
    share = 100 * r["ms"] / (1e3 * step)
    layers = r["layers"] or ""
    print(f"{r['part']:<27} {layers:>6} {each:>8} {r['ms']:>8.1f} {share:>6.1f}% {rate:>8} {frac:>8}")
  return {"step_ms": 1e3 * step, "peak_gflops": peak / 1e9, "cpu": cpu,
          "share": {r["part"]: round(r["ms"] / (1e3 * step), 4) for r in rows},
          "gflops": {r["part"]: round(r["gflops"], 1) for r in rows if r["gflops"] is not None}}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="tiny, batch 2 x seq 64")
  p.add_argument("--variant", default="small", choices=("small", "agent"),
                 help="model config (configs/horizon.py); agent: the RL/SFT model, 8 x 256 unless --seq_len")
  p.add_argument("--batch", type=int, default=0, help="sequences per step (0: config / --quick)")
  p.add_argument("--seq_len", type=int, default=0, help="tokens per sequence (0: config / --quick)")
  p.add_argument("--reps", type=positive_int, default=5, help="timed calls per part (median reported)")
  p.add_argument("--peak_n", type=matmul_sizes, default=[1024, 2048],
                 help="comma-separated matmul sizes of the peak measurement (the best is the peak)")
  print(json.dumps(run(p.parse_args())), flush=True)


if __name__ == "__main__":
  main()
