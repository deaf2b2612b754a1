"""Tokens/s and MFU of the `small` config's train step, against this machine's measured peak.

Run (under the heavy-job lock on shared machines):

    flock /tmp/horizon_heavy.lock python -m experiments.bench.train_step
    python -m experiments.bench.train_step --quick

In one process: the peak FLOP/s of the default device is measured with a
bf16 x bf16 -> f32 matmul (`training.metrics.measure_peak_flops`, the best over --peak_n sizes
and 10 runs each; an f32 one beside it, and on CPU the processor's identity, so a peak can be
checked against the hardware), then the
`small` config's train step (`training.train_step.train_step`, jitted as `jit_train_step` is,
TrainConfig from the config's `train` section; batch global_batch x seq_len of
the config, smaller with --quick or --batch/--seq_len) runs on one device with
a byte-corpus batch (`training.byte_corpus.lm_rows`) on the default device, for each remat policy in --remat.
Compilation, the first step and one warm-up step are excluded; the median of --reps steps is
reported. Each remat policy runs twice (--backward): with the precision policy's backward
products in the compute dtype (model/layers.einsum) and, as the baseline, traced as plain
autodiff (f32 backward products; rows marked /plain). Achieved FLOP/s =
flops_per_token x tokens/s: MFU counts the model's 3 x forward FLOPs, HFU adds the
recomputed forward of rematerialisation (`model.flops.flops_per_token`). Planned memory is XLA's
memory_analysis() of the compiled step (temp + arguments + outputs); a case
above --max_gib is reported as skipped, not run. The last line is a JSON
object with the ratios (MFU, HFU, time of each remat policy over 'none').
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time

import jax
import numpy as np
from flax import nnx

from configs import horizon
from experiments.bench import common
from model import flops
from model.config import ModelConfig
from model.decoder import Horizon
from model.layers import plain_autodiff_matmuls
from training import byte_corpus, metrics
from training.train_step import TrainConfig, make_optimizer, train_step


def _batch(b: int, t: int) -> dict[str, jax.Array]:
  """A byte-corpus batch [b, t] on the default device.

  Committed to that one device like the model, not to a 1-device mesh: a
  mesh-sharded batch with an unsharded model makes the step's outputs
  mesh-sharded, and the second step would compile again.
  """
  rows = byte_corpus.lm_rows(byte_corpus.load_stdlib_bytes(), 0, 0, np.arange(b), t)
  return jax.device_put(rows, jax.devices()[0])


def _time_policy(cfg: ModelConfig, tc: TrainConfig, batch, reps: int, max_bytes: float,
                 plain: bool = False) -> dict:
  """Compiles and times one train step; returns seconds (None if skipped), bytes, last metrics.

  plain: trace the model's matmuls as plain autodiff (f32 backward products; the baseline of the
  precision policy, model/layers.plain_autodiff_matmuls)."""
  with plain_autodiff_matmuls() if plain else contextlib.nullcontext():
    return _time_step(cfg, tc, batch, reps, max_bytes)


def _time_step(cfg: ModelConfig, tc: TrainConfig, batch, reps: int, max_bytes: float) -> dict:
  model = Horizon(cfg, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, make_optimizer(tc), wrt=nnx.Param)
  # A fresh jit per case: the backward mode is fixed at trace time, not in jit's cache key.
  jit_train_step = nnx.jit(train_step, static_argnames=("tc",), donate_argnums=(0, 1))
  t0 = time.perf_counter()
  nbytes = common.compiled_peak_bytes(jit_train_step.lower(model, optimizer, batch, tc).compile())
  compile_s = time.perf_counter() - t0
  if nbytes > max_bytes:
    return {"seconds": None, "bytes": nbytes, "compile_s": compile_s}
  for _ in range(2):  # the call's own compile + first step, then a warm-up step
    jax.block_until_ready(jit_train_step(model, optimizer, batch, tc))
  times, raw = [], None
  for _ in range(reps):
    t0 = time.perf_counter()
    raw = jax.block_until_ready(jit_train_step(model, optimizer, batch, tc))
    times.append(time.perf_counter() - t0)
  raw = {k: np.asarray(v) for k, v in raw.items()}
  return {"seconds": statistics.median(times), "bytes": nbytes, "compile_s": compile_s, "raw": raw,
          "bias_norm": metrics.router_bias_norm(model)}


def run(a: argparse.Namespace) -> dict:
  """Prints the table; returns the JSON summary."""
  config = horizon.get_config("small")
  cfg = ModelConfig.from_config(config.model)
  tc = TrainConfig.from_config(config.train)
  tc = dataclasses.replace(tc, global_batch=a.batch or (2 if a.quick else tc.global_batch),
                           seq_len=a.seq_len or (128 if a.quick else tc.seq_len))
  b, t = tc.global_batch, tc.seq_len
  sizes = [1024] if a.quick else a.peak_n
  peak, peak_n = common.best_peak_flops(sizes, max(a.reps, 10))
  peak_f32, _ = common.best_peak_flops(sizes, max(a.reps, 10), dtype="float32")
  print(f"train step: config small, batch {b} x seq {t} = {b * t} tokens, backend "
        f"{jax.default_backend()} ({jax.devices()[0].device_kind}), reps {a.reps}")
  cpu = common.report_cpu()
  print(f"peak (bf16 x bf16 -> f32 matmul, best of n={sizes} at n={peak_n}, measured here): "
        f"{peak / 1e9:.1f} GFLOP/s; "
        f"f32 {peak_f32 / 1e9:.1f} (bf16/f32 {peak / peak_f32:.2f}: ~2 on AVX512-BF16 vector units, "
        "far more on a matrix unit)")
  print(f"{'case':<15} {'step s':>8} {'compile s':>10} {'tokens/s':>10} {'GFLOP/s':>9} {'MFU':>7} "
        f"{'HFU':>7} {'loss':>7} {'peak MiB':>9}", flush=True)
  batch = _batch(b, t)
  out: dict = {"peak_flops": peak, "peak_flops_f32": peak_f32, "bf16_over_f32_peak": peak / peak_f32,
               "cpu": cpu, "tokens_per_step": b * t}
  for policy in a.remat.split(","):
    for backward in a.backward.split(","):
      case = policy if backward == "compute" else f"{policy}/plain"
      pcfg = cfg.replace(remat=policy)
      f = flops.flops_per_token(pcfg, t)
      r = _time_policy(pcfg, tc, batch, a.reps, a.max_gib * 2 ** 30, plain=backward == "plain")
      if r["seconds"] is None:
        print(f"{case:<15} skipped: needs {r['bytes'] / 2 ** 30:.1f} GiB", flush=True)
        out[case] = {"skipped_gib": r["bytes"] / 2 ** 30}
        continue
      d = metrics.derive_metrics(r["raw"], step_seconds=r["seconds"], tokens=b * t,
                                 flops_per_token_train=f["train_model"], peak_flops=peak,
                                 learning_rate=0.0, router_bias_norm=r["bias_norm"])
      hfu = f["train"] * d["tokens_per_s"] / peak
      print(f"{case:<15} {r['seconds']:>8.3f} {r['compile_s']:>10.1f} {d['tokens_per_s']:>10.0f} "
            f"{f['train_model'] * d['tokens_per_s'] / 1e9:>9.2f} {100 * d['mfu']:>6.2f}% "
            f"{100 * hfu:>6.2f}% {d['loss']:>7.3f} {r['bytes'] / 2 ** 20:>9.1f}", flush=True)
      out[case] = {"step_s": r["seconds"], "tokens_per_s": d["tokens_per_s"], "mfu": d["mfu"],
                   "hfu": hfu, "flops_per_token_train": f["train"], "peak_bytes": r["bytes"]}
  base = out.get("none", {}).get("step_s")
  for case in list(out):
    step = out[case].get("step_s") if isinstance(out[case], dict) else None
    if case != "none" and base and step:
      out[f"{case}_over_none_time"] = step / base
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="batch 2 x seq 128, peak n=1024")
  p.add_argument("--batch", type=int, default=0, help="sequences per step (0: config / --quick)")
  p.add_argument("--seq_len", type=int, default=0, help="tokens per sequence (0: config / --quick)")
  p.add_argument("--remat", default="none,full", help="comma-separated remat policies to time")
  p.add_argument("--backward", default="compute,plain",
                 help="compute: backward products in the compute dtype (the policy); plain: plain "
                      "autodiff's f32 backward products (the baseline)")
  p.add_argument("--reps", type=common.positive_int, default=5, help="timed steps (median reported)")
  p.add_argument("--peak_n", type=common.matmul_sizes, default=[1024, 2048],
                 help="comma-separated matmul sizes of the peak measurement (the best is the peak)")
  p.add_argument("--max_gib", type=float, default=16.0, help="skip cases planned above this")
  a = p.parse_args()
  for policy in a.remat.split(","):
    if policy not in ("none", "full", "save_dots"):
      p.error(f"--remat: unknown policy {policy!r}; choose from none, full, save_dots.")
  for backward in a.backward.split(","):
    if backward not in ("compute", "plain"):
      p.error(f"--backward: unknown mode {backward!r}; choose compute and/or plain.")
  print(json.dumps(run(a)), flush=True)


if __name__ == "__main__":
  main()
