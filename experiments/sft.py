"""Supervised warm start on oracle trajectories and chat files (configs/sft.py).

    python -m experiments.sft --config=configs/sft.py:agent --workdir=/tmp/horizon_sft
    # from pretrained weights, on your own conversations (OpenAI chat format JSONL):
    python -m experiments.sft --config=configs/sft.py:agent --workdir=/tmp/sft2 \
        --init_checkpoint=/tmp/pretrain/checkpoints --config.sft.chat_files=chats.jsonl

Loss on assistant tokens only, packed rows whose segments neither attention nor the delta
rule's state crosses; checkpoints in <workdir>/checkpoints resume, and `experiments.serve` /
`experiments.evaluate --checkpoint` load them. Last line: the run summary as JSON.
"""

from __future__ import annotations

import json

from absl import flags

from experiments.config_util import apply_init_checkpoint, define_config_flag, log_to_workdir, run_app
from rl.sft.train import run_sft

_CONFIG = define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics.jsonl).", required=True)
_INIT = flags.DEFINE_string("init_checkpoint", None, "Start from these weights (a pretraining checkpoint "
                            "directory); same as --config.checkpoint.init_from.")


def main(argv):
  del argv
  config = _CONFIG.value
  apply_init_checkpoint(config, _INIT.value)
  log_to_workdir(_WORKDIR.value, "sft")
  summary = run_sft(config, _WORKDIR.value)
  print(json.dumps(summary), flush=True)


if __name__ == "__main__":
  run_app(main)
