"""The training loop's data: global batches from `config.data.pipeline` = 'grain' | 'bytes'.

grain  config.data.sources tokenized (config.data.tokenizer, default: the
       bundled one) into ArrayRecord shards by process 0, then the grain
       pipeline (`training.data`: shuffled, mixed, packed); each process reads
       global_batch / processes rows. Resume restores the iterator's state,
       refusing one written under another shuffle_seed, packing, seq_len or
       source mixture (a bare iterator state, as older checkpoints hold, is
       restored unchecked).
bytes  windows of the running interpreter's standard-library source as raw
       bytes (`training.byte_corpus`): no tokenizer, no preparation, ids
       0..255. Row r of step s is addressed by (config.data.shuffle_seed, s,
       r), so each process builds exactly the rows its devices hold, the
       global batch is the same for any number of processes (a multi-host run
       reproduces a single-process run), and resuming needs no iterator state.

Both yield `batch(step)`: a dict of global [global_batch, seq_len] arrays
sharded over the mesh's batch axes, and `get_state()` / `set_state()` for the
checkpoint.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from model.config import ConfigError, ModelConfig
from sharding.rules import activation_spec
from training import byte_corpus
from training import data as data_lib
from training.data_sources import DataError, parse_sources
from training.tokenizer import default_tokenizer_path, load_tokenizer
from training.train_step import TrainConfig

PIPELINES = ("grain", "bytes")


def tokenizer_for(config):
  """The run's tokenizer (config.data.tokenizer or the variant's bundled one), checked against the model."""
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


def _local_batch(tc: TrainConfig) -> int:
  n = jax.process_count()
  if tc.global_batch % n:
    raise ConfigError(f"config.train.global_batch={tc.global_batch} is not divisible by the "
                      f"{n} processes; each process loads global_batch / processes rows.")
  return tc.global_batch // n


def _from_process_rows(mesh, local: dict[str, np.ndarray], global_batch: int) -> dict[str, jax.Array]:
  out = {}
  for name, value in local.items():
    shape = (global_batch,) + value.shape[1:]
    spec = activation_spec(("batch",) + ("length",) * (value.ndim - 1), shape, dict(mesh.shape))
    out[name] = jax.make_array_from_process_local_data(jax.sharding.NamedSharding(mesh, spec), value, shape)
  return out


def _check_seed(seed: Any, pipeline: str) -> int:
  if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:  # numpy's generator needs >= 0
    raise ConfigError(f"config.data.shuffle_seed={seed!r}: the {pipeline} pipeline needs an int >= 0.")
  return seed


_SETTING_FLAGS = {"shuffle_seed": "config.data.shuffle_seed", "packing": "config.data.packing",
                  "seq_len": "config.train.seq_len", "sources": "config.data.sources"}


def _check_settings(saved: dict, now: dict) -> None:
  """DataError naming the first setting the checkpoint's grain stream was written under that differs."""
  for key, flag in _SETTING_FLAGS.items():
    if key in saved and saved[key] != now[key]:
      fix = repr(saved[key]) if isinstance(saved[key], str) else saved[key]  # shell-quoted
      raise DataError(f"the checkpoint's grain batches used {flag}={saved[key]!r}, this run {now[key]!r}; "
                      f"resume with --{flag}={fix}, or start a new --workdir.")
  if "weights" in saved and saved["weights"] != now["weights"]:
    raise DataError(f"the checkpoint's grain batches mixed the prepared sources with weights "
                    f"{saved['weights']}, this run's prepared data has {now['weights']}; resume with "
                    f"--config.data.sources={saved.get('sources')!r} (and its --config.data.prepared_dir), "
                    "or start a new --workdir.")


class GrainBatches:
  """config.data.pipeline = 'grain': tokenized, prepared shards through the grain pipeline."""

  pipeline = "grain"
  # each process's iterator state indexes its own slice of the shards, so a state written by
  # another number of processes cannot be resumed (training/loop.py restarts the pipeline)
  per_process_state = True

  def __init__(self, config, workdir: str, mesh: jax.sharding.Mesh, tc: TrainConfig):
    if config.data.packing not in data_lib.PACKINGS:  # before minutes of data preparation
      raise ConfigError(f"config.data.packing={config.data.packing!r}: choose one of {data_lib.PACKINGS}.")
    _check_seed(config.data.shuffle_seed, "grain")  # else the first batch fails, after the preparation
    self.config, self.workdir, self.mesh, self.tc = config, workdir, mesh, tc
    self.tokenizer = tokenizer_for(config)
    self.manifest = prepare_data(config, workdir, self.tokenizer)
    self.local_batch = _local_batch(tc)
    self._it = None

  def start(self) -> None:
    """Opens the pipeline (after the model is built: the order of the original loop)."""
    ds = data_lib.make_lm_dataset(
        prepared_dir(self.config, self.workdir), None, self.tc.seq_len, self.local_batch,
        seed=self.config.data.shuffle_seed, process_index=jax.process_index(),
        process_count=jax.process_count(), packing=self.config.data.packing)
    self._it = iter(ds)

  def batch(self, step: int) -> dict[str, jax.Array]:
    del step  # the iterator's position is the step
    return _from_process_rows(self.mesh, next(self._it), self.tc.global_batch)

  def settings(self) -> dict:
    """What the stream's order depends on: a resume under other values would repeat or skip documents."""
    return {"shuffle_seed": self.config.data.shuffle_seed, "packing": self.config.data.packing,
            "seq_len": self.tc.seq_len, "sources": self.config.data.sources,
            "weights": {n: s["weight"] for n, s in sorted(self.manifest["sources"].items())}}

  def get_state(self) -> dict:
    return {"pipeline": "grain", "settings": self.settings(), "iterator": self._it.get_state()}

  def set_state(self, state: Any) -> None:
    """Resumes the iterator; a state without "pipeline" is a bare iterator state (older checkpoints)."""
    if isinstance(state, dict) and state.get("pipeline") == "bytes":
      raise DataError("the checkpoint was written with config.data.pipeline='bytes'; resume it with "
                      "--config.data.pipeline=bytes, or start a new --workdir.")
    if isinstance(state, dict) and state.get("pipeline") == "grain":
      _check_settings(state.get("settings") or {}, self.settings())
      state = state["iterator"]
    self._it.set_state(state)

  def summary(self) -> dict:
    return {"prepared_dir": prepared_dir(self.config, self.workdir),
            "data_tokens": sum(s["tokens"] for s in self.manifest["sources"].values())}


class ByteBatches:
  """config.data.pipeline = 'bytes': addressed windows of the stdlib's bytes (no iterator state)."""

  pipeline = "bytes"
  per_process_state = False  # batches are addressed by step: any process count resumes exactly

  def __init__(self, config, cfg: ModelConfig, mesh: jax.sharding.Mesh, tc: TrainConfig):
    if cfg.vocab_size < 256:
      raise ConfigError(f"config.model.vocab_size={cfg.vocab_size}: config.data.pipeline='bytes' "
                        "needs >= 256 ids (one per byte).")
    seed = _check_seed(config.data.shuffle_seed, "bytes")
    self.mesh, self.tc, self.seed = mesh, tc, seed
    self.corpus = byte_corpus.load_stdlib_bytes()

  def start(self) -> None:
    pass

  def batch(self, step: int) -> dict[str, jax.Array]:
    tc = self.tc
    return byte_corpus.global_batch(
        self.mesh, tc.global_batch, tc.seq_len,
        lambda rows: byte_corpus.lm_rows(self.corpus, self.seed, step, rows, tc.seq_len))

  def get_state(self) -> dict:
    return {"pipeline": "bytes", "seed": self.seed}

  def set_state(self, state: Any) -> None:
    if not (isinstance(state, dict) and state.get("pipeline") == "bytes"):
      raise DataError("the checkpoint was written with config.data.pipeline='grain'; resume it with "
                      "--config.data.pipeline=grain, or start a new --workdir.")
    if state["seed"] != self.seed:
      raise DataError(f"the checkpoint's byte batches used config.data.shuffle_seed={state['seed']}, "
                      f"this run {self.seed}; resume with --config.data.shuffle_seed={state['seed']}.")

  def summary(self) -> dict:
    return {"prepared_dir": None, "data_tokens": int(len(self.corpus))}


def make_batches(config, workdir: str, cfg: ModelConfig, mesh: jax.sharding.Mesh,
                 tc: TrainConfig) -> GrainBatches | ByteBatches:
  """The batch source config.data.pipeline names (grain prepares its data here, on process 0)."""
  pipeline = config.data.pipeline
  if pipeline == "grain":
    return GrainBatches(config, workdir, mesh, tc)
  if pipeline == "bytes":
    return ByteBatches(config, cfg, mesh, tc)
  raise ConfigError(f"config.data.pipeline={pipeline!r}: choose one of {PIPELINES}.")
