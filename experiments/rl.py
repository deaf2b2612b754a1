"""Joint multi-domain RL from an SFT (or pretrained) checkpoint (configs/rl.py).

    python -m experiments.rl --config=configs/rl.py:grpo --workdir=/tmp/horizon_rl \
        --init_checkpoint=/tmp/horizon_sft/checkpoints
    python -m experiments.rl --config=configs/rl.py:dapo --workdir=/tmp/rl_dapo \
        --init_checkpoint=/tmp/horizon_sft/checkpoints --config.rl.mixture='math=2,terminal=1'

Run the same command again to resume from <workdir>/checkpoints. Metrics go to the console,
<workdir>/metrics.jsonl and TensorBoard (per-domain reward, success, tokens, entropy, TIS and
KL diagnostics, mixture weights), a few whole episodes per step to
<workdir>/trajectories.jsonl, absl/orbax INFO lines to <workdir>/logs/rl.INFO;
`experiments.serve --checkpoint=<workdir>/checkpoints` serves the policy and
`experiments.evaluate --checkpoint=...` evaluates it. Last line: the summary as JSON.

Many processes (hosts): the same command on each, plus --coordinator_address=HOST0:PORT
--num_processes=N --process_id=I (or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID), as for pretraining. The update runs on the global mesh; each process plays
its share of every step's groups on its own engine (rl/train/trainer.py); process 0 writes the
metrics, trajectories and evaluations and prints the summary.
"""

from __future__ import annotations

import json

import jax
from absl import flags
from ml_collections import config_flags

from experiments.config_util import (
  apply_init_checkpoint,
  define_config_flag,
  define_distributed_flags,
  log_to_workdir,
  run_app,
)
from rl.train.checks import check_rl_overrides
from rl.train.trainer import run

_CONFIG = define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics).", required=True)
_INIT = flags.DEFINE_string("init_checkpoint", None, "Start the policy from these weights (an SFT or "
                            "pretraining checkpoint directory); same as --config.checkpoint.init_from.")
_INIT_DISTRIBUTED = define_distributed_flags()


def main(argv):
  del argv
  config = _CONFIG.value
  check_rl_overrides(config_flags.get_override_values(flags.FLAGS["config"]))
  apply_init_checkpoint(config, _INIT.value)
  _INIT_DISTRIBUTED()
  log_to_workdir(_WORKDIR.value, "rl" if jax.process_count() == 1 else f"rl.p{jax.process_index()}")
  summary = run(config, _WORKDIR.value)
  summary.pop("history", None)
  if jax.process_index() == 0:
    print(json.dumps(summary, default=str), flush=True)


if __name__ == "__main__":
  run_app(main)
