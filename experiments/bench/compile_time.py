"""Compile time of the forward and the train step at 8/24/93 layers, scanned vs unrolled.

Run:

    python -m experiments.bench.compile_time
    python -m experiments.bench.compile_time --layers=8,24 --timeout_s=120

The model is `tiny` in width with the full design's layer pattern (Gated DSA
every 4th layer from 0, dense FFN for the first 3 layers, MoE after), so 93
layers are the full stack's 24 DSA + 69 Delta layers. Each case runs in a
fresh child process with the persistent compilation cache off, so every
figure is a cold trace + lower (`jax.jit(...).lower`) and XLA compile
(`.compile()`); a case past --timeout_s is reported as such (the unrolled
93-layer train step did not finish in 5.5 minutes on this machine before
scan_layers). Scanned: `config.model.scan_layers` (model/scan.py), which
needs two whole periods after the dense layers, so at 8 layers (one period)
both columns run the same unrolled program. The last line is JSON with the
times and the unrolled / scanned ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PATTERN = dict(dsa_period=4, dsa_offset=0, num_dense_layers=3)


def _case(what: str, layers: int, scan: bool, seq: int) -> dict:
  """In the child: trace + lower and compile one program; returns seconds."""
  import jax  # noqa: PLC0415 - the child imports JAX with the cache off
  import numpy as np  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from configs import horizon  # noqa: PLC0415
  from model.config import ModelConfig  # noqa: PLC0415
  from model.decoder import Horizon  # noqa: PLC0415
  from model.scan import layer_plan  # noqa: PLC0415
  from training import byte_corpus  # noqa: PLC0415
  from training.train_step import TrainConfig, jit_train_step, make_optimizer  # noqa: PLC0415

  config = horizon.get_config("tiny")
  cfg = ModelConfig.from_config(config.model).replace(num_layers=layers, scan_layers=scan, **PATTERN)
  model = Horizon(cfg, rngs=nnx.Rngs(0))
  rows = byte_corpus.lm_rows(byte_corpus.load_stdlib_bytes(), 0, 0, np.arange(2), seq)
  t0 = time.perf_counter()
  if what == "forward":
    lowered = nnx.jit(lambda m, t: m(t)).lower(model, rows["inputs"])
  else:
    tc = TrainConfig.from_config(config.train)
    optimizer = nnx.Optimizer(model, make_optimizer(tc), wrt=nnx.Param)
    lowered = jit_train_step.lower(model, optimizer, rows, tc)
  t1 = time.perf_counter()
  lowered.compile()
  t2 = time.perf_counter()
  return {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0,
          "scanned_units": layer_plan(cfg).repeats, "backend": jax.default_backend()}


def _spawn(what: str, layers: int, scan: bool, seq: int, timeout_s: float) -> dict:
  env = dict(os.environ)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  cmd = [sys.executable, "-m", "experiments.bench.compile_time", "--child",
         f"{what}:{layers}:{int(scan)}:{seq}"]
  try:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=True)
  except subprocess.TimeoutExpired:
    return {"timed_out_s": timeout_s}
  except subprocess.CalledProcessError as e:
    raise RuntimeError(f"case {what} {layers} scan={scan} failed:\n{e.stderr[-3000:]}") from e
  return json.loads(out.stdout.strip().splitlines()[-1])


def _fmt(r: dict) -> str:
  return f">{r['timed_out_s']:.0f} (timeout)" if "timed_out_s" in r else f"{r['total_s']:.1f}"


def run(a: argparse.Namespace) -> dict:
  layers = [int(x) for x in a.layers.split(",")]
  print(f"compile time (cold, no persistent cache): tiny width, full layer pattern {PATTERN}, "
        f"batch 2 x seq {a.seq}, timeout {a.timeout_s:.0f} s per case")
  print(f"{'program':<11} {'layers':>6} {'units':>6} {'unrolled s':>16} {'scanned s':>10} "
        f"{'(lower+compile)':>16} {'unrolled/scanned':>17}", flush=True)
  out: dict = {}
  for what in a.programs.split(","):
    for n in layers:
      un = _spawn(what, n, False, a.seq, a.timeout_s)
      sc = _spawn(what, n, True, a.seq, a.timeout_s)
      ratio = (un["total_s"] / sc["total_s"]) if "total_s" in un and "total_s" in sc else None
      split = f"{sc['lower_s']:.1f}+{sc['compile_s']:.1f}" if "total_s" in sc else "-"
      rs = f"{ratio:.2f}x" if ratio else (f">{a.timeout_s / sc['total_s']:.1f}x" if "total_s" in sc else "-")
      print(f"{what:<11} {n:>6} {sc.get('scanned_units', '-'):>6} {_fmt(un):>16} {_fmt(sc):>10} "
            f"{split:>16} {rs:>17}", flush=True)
      out[f"{what}_{n}"] = {"unrolled": un, "scanned": sc, "unrolled_over_scanned": ratio}
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", default="8,24,93", help="comma-separated depths")
  p.add_argument("--programs", default="forward,train_step", help="forward and/or train_step")
  p.add_argument("--seq", type=int, default=64, help="tokens per row of the traced batch")
  p.add_argument("--timeout_s", type=float, default=330.0, help="per case (one child process)")
  p.add_argument("--child", default="", help=argparse.SUPPRESS)
  a = p.parse_args()
  if a.child:
    what, n, scan, seq = a.child.split(":")
    print(json.dumps(_case(what, int(n), bool(int(scan)), int(seq))), flush=True)
    return
  for what in a.programs.split(","):
    if what not in ("forward", "train_step"):
      p.error(f"--programs: unknown program {what!r}; choose forward and/or train_step.")
  print(json.dumps(run(a)), flush=True)


if __name__ == "__main__":
  main()
