"""Pretraining launcher: tokenizer -> prepared data -> sharded train loop -> checkpoints + metrics.

    python -m experiments.pretrain --config=configs/pretrain.py:tiny --workdir=/tmp/horizon_tiny
    # overrides: --config.train.steps=1000 --config.mesh.expert=4 --config.data.sources='stdlib=1.0'
    # many hosts: add --coordinator_address=HOST0:1234 --num_processes=N --process_id=I

What happens (training/loop.py):
  1. The tokenizer is loaded (config.data.tokenizer, default: the bundled one)
     and checked against config.model (vocab size, <|image|> id).
  2. Process 0 tokenizes config.data.sources into ArrayRecord shards under
     config.data.prepared_dir (default <workdir>/data); a no-op when up to date.
  3. The model and AdamW state are created sharded on the mesh of config.mesh;
     if <workdir>/checkpoints holds a checkpoint, everything (weights,
     optimizer, step, RNG, data iterator position) resumes from the latest.
  4. The grain pipeline (shuffled, mixed, packed, this process's share of each
     global batch) feeds the jitted train step; metrics go to the console,
     <workdir>/metrics.jsonl and TensorBoard; checkpoints are saved
     asynchronously every config.checkpoint.every steps and at the end.
workdir may be a local path or a URL (gs://, s3://).
"""

from __future__ import annotations

import json

import jax
from absl import app, flags

from experiments import distributed
from experiments.config_util import define_config_flag
from training.loop import run

_CONFIG = define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (local path or URL).")


def main(argv):
  del argv
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required (a local path or a gs:// / s3:// URL).")
  distributed.initialize()
  summary = run(_CONFIG.value, _WORKDIR.value)
  if jax.process_index() == 0:
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
  app.run(main)
