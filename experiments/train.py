"""Training launcher: one config, any device count, one or many processes.

    python -m experiments.train --config=configs/horizon.py:tiny
    # 8 fake CPU devices, experts over 4 of them:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.train \
        --config=configs/horizon.py:tiny_sharded --config.mesh.expert=4
    # two processes (each its own host in a real cluster):
    python -m experiments.train --config=... --coordinator_address=10.0.0.1:1234 \
        --num_processes=2 --process_id=0   # and --process_id=1 on the other

The mesh comes from `config.mesh`, optimisation from `config.train`. Data: the
byte-level standard-library corpus (`training.byte_corpus`); each process
builds only the batch rows its devices hold. Prints one JSON line of metrics
per step (process 0) and, last, a JSON summary with the per-step losses.
"""

from __future__ import annotations

import json
import time

import jax
from absl import app, flags
from flax import nnx

from experiments import distributed
from experiments.config_util import define_config_flag, model_config
from model.decoder import Horizon
from sharding import mesh as mesh_lib
from sharding.state import create_sharded_model
from training import byte_corpus
from training.loop import host_value
from training.metrics import load_ratios
from training.train_step import TrainConfig, grad_names, jit_train_step, make_train_state, nonfinite_report

_CONFIG = define_config_flag()
_LOG_EVERY = flags.DEFINE_integer("log_every", 1, "Print metrics every N steps.")


def _host_metrics(metrics: dict) -> dict:
  out = {}
  for k, v in metrics.items():
    v = host_value(v)
    if k in ("grad_finite", "param_finite"):
      continue
    if k == "load":
      out.update(load_ratios(v))
    else:
      out[k] = float(v)
  return out


def run(config) -> list[float]:
  cfg = model_config(config)
  tc = TrainConfig.from_config(config.train)
  mesh = mesh_lib.make_mesh(config.mesh)
  if cfg.vocab_size < 256:
    raise ValueError(f"config.model.vocab_size={cfg.vocab_size}: the byte corpus needs >= 256 ids.")
  corpus = byte_corpus.load_stdlib_bytes()
  with mesh_lib.activate(mesh):
    model = create_sharded_model(lambda: Horizon(cfg, rngs=nnx.Rngs(config.seed)), mesh)
    optimizer = make_train_state(model, tc)
    names = grad_names(model, optimizer)
    losses = []
    for step in range(tc.steps):
      batch = byte_corpus.global_batch(
          mesh, tc.global_batch, tc.seq_len,
          lambda rows, s=step: byte_corpus.lm_rows(corpus, config.seed, s, rows, tc.seq_len))
      t0 = time.perf_counter()
      raw = jit_train_step(model, optimizer, batch, tc)
      problem = nonfinite_report(step, {k: host_value(raw[k]) for k in
                                        ("finite", "loss", "grad_finite", "param_finite")}, names)
      if problem and tc.nan_policy == "stop":
        raise FloatingPointError(problem)
      metrics = _host_metrics(raw)
      metrics["step_seconds"] = time.perf_counter() - t0
      losses.append(metrics["loss"])
      if jax.process_index() == 0 and (step % _LOG_EVERY.value == 0 or step == tc.steps - 1):
        print(json.dumps({"step": step, **metrics}), flush=True)
  return losses


def main(argv):
  del argv
  distributed.initialize()
  losses = run(_CONFIG.value)
  if jax.process_index() == 0:
    print(json.dumps({"losses": losses, "processes": jax.process_count(),
                      "devices": jax.device_count()}), flush=True)


if __name__ == "__main__":
  app.run(main)
