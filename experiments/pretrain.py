"""Pretraining launcher: one config, any mesh, one or many processes (training/loop.py).

    python -m experiments.pretrain --config=configs/pretrain.py:tiny --workdir=/tmp/horizon_tiny
    # overrides: --config.train.steps=1000 --config.mesh.expert=4 --config.data.sources='stdlib=1.0'
    # 8 fake CPU devices, 2-way data x 4-way expert parallelism, raw-byte data:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.pretrain \
        --config=configs/pretrain.py:tiny_sharded --workdir=/tmp/horizon_mesh \
        --config.data.pipeline=bytes --config.mesh.data=2 --config.mesh.fsdp=1 --config.mesh.expert=4
    # many hosts: the same command on each, plus
    #   --coordinator_address=HOST0:1234 --num_processes=N --process_id=I
    # (or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID; --distributed=on
    # discovers them on TPU pods, SLURM, Open MPI)

Data (config.data.pipeline, training/batches.py): 'grain' tokenizes
config.data.sources into shards under config.data.prepared_dir (default
<workdir>/data) and streams them; 'bytes' trains on the standard library's
raw bytes, the same global batch for any number of processes. The model and
AdamW state are sharded on config.mesh; everything resumes from the latest
checkpoint in <workdir>/checkpoints. Metrics go to the console,
<workdir>/metrics.jsonl (one JSON object per logged step) and TensorBoard.
Process 0 prints, last, one JSON line: the run summary with the per-step
`losses`, `processes` and `devices`. workdir may be a local path or a URL
(gs://, s3://).
"""

from __future__ import annotations

import json

import jax
from absl import app, flags

from experiments.config_util import define_config_flag, define_distributed_flags, log_to_workdir, run_app
from training.loop import run

_CONFIG = define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (local path or URL).")
_INIT_DISTRIBUTED = define_distributed_flags()


def main(argv):
  del argv
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required (a local path or a gs:// / s3:// URL).")
  _INIT_DISTRIBUTED()
  log_to_workdir(_WORKDIR.value, f"pretrain.p{jax.process_index()}")
  summary = run(_CONFIG.value, _WORKDIR.value)
  if jax.process_index() == 0:
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
  run_app(main)
