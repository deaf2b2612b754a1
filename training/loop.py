"""The pretraining loop behind `experiments/pretrain.py` and the quickstart.

`run(config, workdir)`:
  1. loads the tokenizer (config.data.tokenizer, default: the bundled one) and
     checks it against config.model (vocab size, <|image|> id);
  2. process 0 tokenizes config.data.sources into ArrayRecord shards under
     config.data.prepared_dir (default <workdir>/data), a no-op when up to date;
  3. creates the model and AdamW state sharded on the mesh of config.mesh, or
     resumes everything (weights, optimizer, step, RNG, data iterator
     position) from the latest checkpoint in <workdir>/checkpoints;
  4. feeds this process's share of each global batch from the grain pipeline
     to the jitted train step; metrics go to the console, <workdir>/metrics.jsonl
     and TensorBoard; checkpoints are saved asynchronously every
     config.checkpoint.every steps and at the end.
workdir may be a local path or a URL (gs://, s3://).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np
from absl import logging
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from experiments.config_util import model_config
from model.decoder import Horizon
from sharding import mesh as mesh_lib
from sharding.rules import activation_spec
from sharding.state import create_sharded_model
from training import data as data_lib
from training import metrics as metrics_lib
from training.checkpoint import Checkpointer
from training.data_sources import parse_sources
from training.tokenizer import default_tokenizer_path, load_tokenizer
from training.train_step import (
  TrainConfig,
  grad_names,
  jit_train_step,
  make_train_state,
  nonfinite_report,
)

_FLAGS_KEYS = ("finite", "loss", "grad_finite", "param_finite")


def tokenizer_for(config):
  cfg = config.model
  path = config.data.tokenizer or default_tokenizer_path(config.variant)
  return load_tokenizer(path, model_vocab_size=cfg.vocab_size, image_token_id=cfg.image_token_id)


def prepared_dir(config, workdir: str) -> str:
  return config.data.prepared_dir or str(epath.Path(workdir) / "data")


def prepare_data(config, workdir: str, tokenizer) -> dict:
  """Process 0 prepares the shards; every process waits, then reads the manifest."""
  out = prepared_dir(config, workdir)
  if jax.process_index() == 0:
    data_lib.prepare(parse_sources(config.data.sources), tokenizer, out,
                     max_docs=config.data.max_docs or None, log=logging.info)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("horizon_prepare_data")
  return data_lib.load_manifest(out)


def host_value(v: jax.Array) -> np.ndarray:
  """A metric as numpy on every process (it may be split over other processes' devices)."""
  return np.asarray(v if v.is_fully_replicated else multihost_utils.process_allgather(v, tiled=True))


def _global_batch(mesh, local: dict[str, np.ndarray], global_batch: int) -> dict[str, jax.Array]:
  out = {}
  for name, value in local.items():
    shape = (global_batch,) + value.shape[1:]
    spec = activation_spec(("batch",) + ("length",) * (value.ndim - 1), shape, dict(mesh.shape))
    out[name] = jax.make_array_from_process_local_data(jax.sharding.NamedSharding(mesh, spec), value, shape)
  return out


def _check_batching(tc: TrainConfig) -> int:
  n = jax.process_count()
  if tc.global_batch % n:
    raise ValueError(f"config.train.global_batch={tc.global_batch} is not divisible by the "
                     f"{n} processes; each process loads global_batch / processes rows.")
  return tc.global_batch // n


class _Run:
  """State of one launch: model, optimizer, data iterator, checkpointer, logger."""

  def __init__(self, config, workdir: str):
    self.config, self.workdir = config, workdir
    self.cfg = model_config(config)
    self.tc = TrainConfig.from_config(config.train)
    self.tokenizer = tokenizer_for(config)
    self.manifest = prepare_data(config, workdir, self.tokenizer)
    self.mesh = mesh_lib.make_mesh(config.mesh)
    self.local_batch = _check_batching(self.tc)

  def build(self) -> None:
    cfg, tc, config = self.cfg, self.tc, self.config
    self.model = create_sharded_model(lambda: Horizon(cfg, rngs=nnx.Rngs(config.seed)), self.mesh)
    self.optimizer = make_train_state(self.model, tc)
    self.names = grad_names(self.model, self.optimizer)
    ds = data_lib.make_lm_dataset(
        prepared_dir(config, self.workdir), None, tc.seq_len, self.local_batch,
        seed=config.data.shuffle_seed, process_index=jax.process_index(),
        process_count=jax.process_count(), packing=config.data.packing)
    self.data = iter(ds)
    self.rng = jax.random.key(config.seed)
    self.ckpt = Checkpointer(str(epath.Path(self.workdir) / "checkpoints"),
                             every=config.checkpoint.every, keep=config.checkpoint.keep,
                             async_save=config.checkpoint.async_save)
    self.start = 0
    if self.ckpt.latest_step() is not None:
      meta = self.ckpt.restore(model=self.model, optimizer=self.optimizer)
      self.start = int(meta["step"])
      self.data.set_state(meta["data_state"])
      if meta.get("rng") is not None:
        self.rng = meta["rng"]
      logging.info("resumed from %s at step %d", self.ckpt.directory, self.start)

  def save(self, step: int, force: bool = False) -> bool:
    return self.ckpt.save(step, model=self.model, optimizer=self.optimizer,
                          data_state=self.data.get_state(), rng=self.rng,
                          config=self.config.to_dict(), force=force)

  def step(self, step: int, flops_train: float, peak: float) -> dict[str, Any]:
    tc = self.tc
    batch = _global_batch(self.mesh, next(self.data), tc.global_batch)
    t0 = time.perf_counter()
    raw = jit_train_step(self.model, self.optimizer, batch, tc)
    flags_ = {k: host_value(raw[k]) for k in _FLAGS_KEYS}
    seconds = time.perf_counter() - t0
    problem = nonfinite_report(step, flags_, self.names)
    if problem:
      if tc.nan_policy == "stop":
        raise FloatingPointError(problem)
      logging.warning("%s", problem)
    host = {k: host_value(v) for k, v in raw.items() if k not in ("grad_finite", "param_finite")}
    return metrics_lib.derive_metrics(
        host, step_seconds=seconds, tokens=tc.global_batch * tc.seq_len,
        flops_per_token_train=flops_train, peak_flops=peak,
        learning_rate=float(host["learning_rate"]),
        router_bias_norm=metrics_lib.router_bias_norm(self.model))


def run(config, workdir: str) -> dict[str, Any]:
  """Trains config.train.steps steps (resuming if a checkpoint exists); returns the summary."""
  r = _Run(config, workdir)
  tc = r.tc
  flops_train = metrics_lib.flops_per_token(r.cfg, tc.seq_len)["train_model"]  # MFU: no recompute
  per_device, source = metrics_lib.resolve_peak_flops(config.metrics.peak_flops)
  peak = metrics_lib.total_peak_flops(per_device, jax.device_count(), jax.default_backend())
  logging.info("peak %.3g FLOP/s per device (%s); %.3g train FLOPs per token", per_device, source,
               flops_train)
  with mesh_lib.activate(r.mesh):
    r.build()
    logger = metrics_lib.MetricsLogger(workdir, total_steps=tc.steps,
                                       tensorboard=config.metrics.tensorboard)
    losses = []
    for step in range(r.start, tc.steps):
      m = r.step(step, flops_train, peak)
      losses.append(m["loss"])
      if step % config.metrics.log_every == 0 or step == tc.steps - 1:
        logger.log(step, m)
      r.save(step + 1)
    r.save(tc.steps, force=True)
    r.ckpt.wait()
    summary = logger.close()
  summary.update({"workdir": str(workdir), "checkpoint_dir": str(r.ckpt.directory),
                  "latest_checkpoint": r.ckpt.latest_step(), "start_step": r.start,
                  "losses": losses, "peak_flops_per_device": per_device, "peak_source": source,
                  "prepared_dir": prepared_dir(config, workdir),
                  "data_tokens": sum(s["tokens"] for s in r.manifest["sources"].values())})
  r.ckpt.close()
  return summary
