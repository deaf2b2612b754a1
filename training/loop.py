"""The one training loop: behind `experiments/pretrain.py` and the quickstart.

`run(config, workdir)`, for any mesh (config.mesh) and one or many processes:
  1. builds the batch source config.data.pipeline names (`training.batches`):
     'grain' loads and checks the tokenizer and has process 0 tokenize
     config.data.sources into ArrayRecord shards (a no-op when up to date);
     'bytes' reads the standard library's source as raw bytes;
  2. creates the model and AdamW state sharded on the mesh, or resumes
     everything (weights, optimizer, step, RNG, data position) from the
     latest checkpoint in <workdir>/checkpoints;
  3. feeds each global batch (every process builds only its own rows) to the
     jitted train step; a non-finite loss or gradient stops the run naming
     the tensor (config.train.nan_policy='stop') or skips the update ('skip');
     metrics (loss, MFU, expert load, ...) go to the console,
     <workdir>/metrics.jsonl and TensorBoard (process 0); checkpoints are
     saved asynchronously every config.checkpoint.every steps and at the end.
workdir may be a local path or a URL (gs://, s3://).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from model import flops
from model.config import RUNTIME_FIELDS, ConfigError, ModelConfig, model_config
from model.decoder import Horizon, abstract_model
from sharding import mesh as mesh_lib
from sharding import rules as rules_lib
from sharding.state import create_sharded_model
from training import batches as batches_lib
from training import metrics as metrics_lib
from training.checkpoint import (
  Checkpointer,
  CheckpointNotFoundError,
  read_meta,
  restore_params,
  stored_model_config,
)
from training.knobs import check_int_knobs
from training.train_step import (
  TrainConfig,
  grad_names,
  jit_train_step,
  make_train_state,
  nonfinite_report,
)

_FLAGS_KEYS = ("finite", "loss", "grad_finite", "param_finite")
BatchFactory = Callable[..., Any]


def host_value(v: jax.Array) -> np.ndarray:
  """A metric as numpy on every process (it may be split over other processes' devices)."""
  return np.asarray(v if v.is_fully_replicated else multihost_utils.process_allgather(v, tiled=True))


def check_loop_config(config) -> None:
  """config.metrics and config.checkpoint knobs the loop reads, checked before data or model are built."""
  check_int_knobs("metrics", config.metrics, [("log_every", 1, "")])
  check_int_knobs("checkpoint", config.checkpoint, [("every", 1, ""), ("keep", 1, "")])
  peak = config.metrics.get("peak_flops")
  if not isinstance(peak, (int, float)) or isinstance(peak, bool) or not 0 <= peak < float("inf"):
    raise ConfigError(f"config.metrics.peak_flops={peak!r}: give the peak FLOP/s of one device, or 0 to "
                      "measure it (CPU) or look it up (known accelerators).")


def check_init_from(config, run_checkpoints: Any) -> None:
  """config.checkpoint.init_from, before data or model are built.

  A fresh run reads its meta now, so a wrong path fails in a second, not after the data is
  prepared. A resumed run continues from its own checkpoint and ignores init_from (its weights
  come from there); a path other than the one the run started from is said, not silently
  dropped.
  """
  init_from = config.checkpoint.get("init_from") or ""
  if not init_from:
    return
  try:
    resumed = read_meta(run_checkpoints)
  except CheckpointNotFoundError:
    resumed = None
  if resumed is None:
    read_meta(init_from)  # CheckpointNotFoundError names the directory
    return
  started = ((resumed.get("config") or {}).get("checkpoint") or {}).get("init_from") or ""
  if init_from != started:
    logging.warning("config.checkpoint.init_from=%r is ignored: this run resumes from %s (step %d), "
                    "which started from %r", init_from, run_checkpoints, resumed["step"], started)


# config.model fields a resumed run may change: how the same function is computed or planned
# stage changes. Any other difference would train another model on these weights.
RESUMABLE_MODEL_FIELDS = RUNTIME_FIELDS


def check_resume(config, cfg: ModelConfig, run_checkpoints: Any,
                 steps_field: str = "train.steps") -> dict | None:
  """A run resuming from its own checkpoint: its step and model, before data or model are built;
  returns the checkpoint's meta (None for a fresh run).

  With the run's length (config.<steps_field>; RL's is rl.steps) below the checkpoint's step the
  run trained nothing and saved the last weights again under a smaller step; a changed
  config.model either trained on silently or failed a minute later naming a tensor rather than
  the field.
  """
  try:
    meta = read_meta(run_checkpoints)
  except CheckpointNotFoundError:
    return None
  step, (section, field) = int(meta["step"]), steps_field.split(".")
  steps = config[section][field]
  if steps < step:
    raise ConfigError(f"config.{steps_field}={steps} is below step {step} of this run's checkpoint "
                      f"in {run_checkpoints}; raise it to continue the run, or use a new --workdir.")
  try:  # the stored config, with fields added since it was written taken from config.model
    before = dataclasses.asdict(stored_model_config(run_checkpoints, config.model, step))
  except ConfigError as e:
    logging.warning("cannot compare config.model with %s's stored config (%s); resuming as configured",
                    run_checkpoints, e)
    return meta
  now = dataclasses.asdict(cfg)
  changed = [f"{k} (checkpoint {before[k]!r}, now {now[k]!r})" for k in now
             if k not in RESUMABLE_MODEL_FIELDS and before.get(k) != now[k]]
  if changed:
    raise ConfigError(f"config.model differs from the checkpoint this run resumes ({run_checkpoints}, step "
                      f"{step}): {'; '.join(changed)}. Resume with the checkpoint's values, or train the new "
                      "model in a new --workdir (--config.checkpoint.init_from can start it from these "
                      "weights where their shapes agree).")
  return meta


def check_layout(tc: TrainConfig, cfg: ModelConfig, mesh: jax.sharding.Mesh) -> None:
  """The batch, sequence and parameters against the mesh and the model, before data is built.

  A global batch the batch axes do not divide was replicated: every device computed the whole
  batch (and MFU counted it once). A seq_len past max_seq_len skipped the RoPE check. A weight
  dimension a mesh axis does not divide failed only after the data was prepared.
  """
  if tc.seq_len > cfg.max_seq_len:
    raise ConfigError(f"config.train.seq_len={tc.seq_len} exceeds "
                      f"config.model.max_seq_len={cfg.max_seq_len}.")
  axes = rules_lib.current_rules().batch_axes
  shards = math.prod(mesh.shape.get(a, 1) for a in axes)
  if tc.global_batch % (shards * tc.grad_accum):
    raise ConfigError(f"config.train.global_batch={tc.global_batch} is not divisible by grad_accum="
                      f"{tc.grad_accum} x the batch mesh axes {axes} (product {shards}) = "
                      f"{shards * tc.grad_accum}; use a multiple of it.")
  rules_lib.state_specs(nnx.split(abstract_model(cfg))[1], dict(mesh.shape))  # ShardingError names the dim


class _Run:
  """State of one launch: model, optimizer, batch source, checkpointer."""

  def __init__(self, config, workdir: str, make_batches: BatchFactory | None = None):
    self.config, self.workdir = config, workdir
    self.cfg = model_config(config)
    if self.cfg.quantization != "none":
      raise ConfigError(f"config.model.quantization={self.cfg.quantization!r}: training keeps dense weights; "
                        "train with 'none' and convert the finished checkpoint with experiments.quantize.")
    self.tc = TrainConfig.from_config(config.train)
    check_loop_config(config)
    check_init_from(config, epath.Path(workdir) / "checkpoints")
    check_resume(config, self.cfg, epath.Path(workdir) / "checkpoints")
    self.mesh = mesh_lib.make_mesh(config.mesh)
    check_layout(self.tc, self.cfg, self.mesh)
    self.data = (make_batches or batches_lib.make_batches)(config, workdir, self.cfg, self.mesh, self.tc)

  def build(self) -> None:
    cfg, tc, config = self.cfg, self.tc, self.config
    self.model = create_sharded_model(lambda: Horizon(cfg, rngs=nnx.Rngs(config.seed)), self.mesh)
    self.optimizer = make_train_state(self.model, tc)
    self.names = grad_names(self.model, self.optimizer)
    self.data.start()
    self.rng = jax.random.key(config.seed)
    self.ckpt = Checkpointer(str(epath.Path(self.workdir) / "checkpoints"),
                             every=config.checkpoint.every, keep=config.checkpoint.keep,
                             async_save=config.checkpoint.async_save)
    self.start = 0
    if self.ckpt.latest_step() is not None:
      meta = self.ckpt.restore(model=self.model, optimizer=self.optimizer)
      self.start = int(meta["step"])
      if meta["process_count"] != jax.process_count() and self.data.per_process_state:
        # grain's states index each process's slice: equal states (every process read as many
        # batches) would still mean other documents on another count
        logging.warning("the checkpoint's data states were written by %d processes, this run has %d: "
                        "the %s pipeline restarts instead of resuming exactly", meta["process_count"],
                        jax.process_count(), self.data.pipeline)
      elif meta["data_state"] is not None or meta["process_count"] == jax.process_count():
        self.data.set_state(meta["data_state"])
      if meta.get("rng") is not None:
        self.rng = meta["rng"]
      logging.info("resumed from %s at step %d", self.ckpt.directory, self.start)
    elif config.checkpoint.get("init_from"):
      # A fresh run that starts from another run's weights (e.g. SFT from pretraining): the
      # parameters only; the optimizer state, step and data position start anew.
      meta = restore_params(config.checkpoint.init_from, self.model)
      logging.info("initialised weights from %s (step %d)", config.checkpoint.init_from, meta["step"])

  def save(self, step: int, force: bool = False) -> bool:
    return self.ckpt.save(step, model=self.model, optimizer=self.optimizer,
                          data_state=self.data.get_state(), rng=self.rng,
                          config=self.config.to_dict(), force=force)

  def step(self, step: int, flops_train: float, peak: float) -> dict[str, Any]:
    tc = self.tc
    t_data = time.perf_counter()
    batch = self.data.batch(step)
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
    out = metrics_lib.derive_metrics(
        host, step_seconds=seconds, tokens=tc.global_batch * tc.seq_len,
        flops_per_token_train=flops_train, peak_flops=peak,
        learning_rate=float(host["learning_rate"]),
        router_bias_norm=metrics_lib.router_bias_norm(self.model))
    # step_seconds (and tokens/s, MFU) time the train step alone; a data pipeline that cannot
    # keep up shows here, not there.
    out["data_seconds"] = t0 - t_data
    return out


def run(config, workdir: str, make_batches: BatchFactory | None = None) -> dict[str, Any]:
  """Trains config.train.steps steps (resuming if a checkpoint exists); returns the summary.

  make_batches(config, workdir, model_cfg, mesh, train_cfg) builds the batch source (default:
  `training.batches.make_batches`, by config.data.pipeline); callers with their own data
  (rl's SFT) pass one with the same interface: start, batch(step), get_state, set_state,
  summary, and a `pipeline` name.

  The summary (the same on every process): the logger's (final/min loss, mean
  tokens/s and MFU, ...), the per-step `losses` of this launch, `start_step`,
  `latest_checkpoint`, the data `pipeline`, `processes` and `devices`.
  """
  r = _Run(config, workdir, make_batches)
  tc = r.tc
  flops_train = flops.flops_per_token(r.cfg, tc.seq_len)["train_model"]  # MFU: no recompute
  per_device, source = metrics_lib.resolve_peak_flops(config.metrics.peak_flops)
  peak = metrics_lib.total_peak_flops(per_device, jax.device_count(), jax.default_backend())
  logging.info("peak %.3g FLOP/s per device (%s); %.3g train FLOPs per token", per_device, source,
               flops_train)
  with mesh_lib.activate(r.mesh):
    r.build()
    logger = metrics_lib.MetricsLogger(workdir, total_steps=tc.steps,
                                       tensorboard=config.metrics.tensorboard)
    losses = []
    try:
      for step in range(r.start, tc.steps):
        m = r.step(step, flops_train, peak)
        losses.append(m["loss"])
        if step % config.metrics.log_every == 0 or step == tc.steps - 1:
          logger.log(step, m)
        r.save(step + 1)
    except BaseException:
      # A step that fails (a NaN under nan_policy='stop', the data, Ctrl-C) ended the process
      # before the save started a step earlier was committed: the run resumed up to `every` steps
      # further back. Commit it first.
      r.ckpt.close()
      logger.close()  # the files (TensorBoard's buffered events) and the summary of the steps done
      raise
    r.save(tc.steps, force=True)
    r.ckpt.wait()
    summary = logger.close()
  summary.update({"workdir": str(workdir), "checkpoint_dir": str(r.ckpt.directory),
                  "latest_checkpoint": r.ckpt.latest_step(), "start_step": r.start,
                  "losses": losses, "peak_flops_per_device": per_device, "peak_source": source,
                  "pipeline": r.data.pipeline, "processes": jax.process_count(),
                  "devices": jax.device_count(), **r.data.summary()})
  r.ckpt.close()
  return summary
