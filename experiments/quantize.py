"""Converts a dense checkpoint to one with MXFP4 (OCP MX v1.0) weights.

    python -m experiments.quantize --checkpoint=/tmp/run/checkpoints --out=/tmp/run_mxfp4
    python -m experiments.quantize --checkpoint=IN --out=OUT --what=all-linear --mode=ceil

--what=experts (default) stores the routed experts' w_gate/w_up/w_down as
MXFP4 blocks + E8M0 scales (gpt-oss layout, see model/quant.py); all-linear
also every other linear weight of the language model. The output is a normal
Horizon checkpoint (params + meta, no optimizer state) whose stored config
says `model.quantization`, so `training.checkpoint.load_model`,
`experiments.serve` and `experiments.quickstart` load it like any other; the
MoE experts then run through the MXFP4 matmul path.

Nothing partial is ever left at --out: every check (input exists, config,
K divisible by 32, output free) runs before anything is written, and the
checkpoint is written to a sibling temporary directory that is renamed to
--out only once complete.
"""

from __future__ import annotations

import json

from absl import app, flags, logging
from ml_collections import config_flags

from training.quantize import convert

_IN = flags.DEFINE_string("checkpoint", None, "Input checkpoint directory (dense weights).")
_OUT = flags.DEFINE_string("out", None, "Output checkpoint directory (must not exist or be empty).")
_WHAT = flags.DEFINE_enum("what", "experts", ["experts", "all-linear"], "Which weights to quantize.")
_MODE = flags.DEFINE_enum("mode", "floor", ["floor", "ceil"],
                          "E8M0 scale rule: floor = the OCP spec's (saturates the top of the "
                          "range), ceil = never clips.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to convert (default: the latest).")
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config for checkpoints that store none (its model section is used).",
    lock_config=False)


def main(argv):
  del argv
  if not _IN.value or not _OUT.value:
    raise app.UsageError("--checkpoint and --out are required.")
  summary = convert(_IN.value, _OUT.value, _WHAT.value, _MODE.value, _STEP.value, _CONFIG.value)
  logging.info("wrote %s", summary["out"])
  print(json.dumps(summary))


if __name__ == "__main__":
  app.run(main)
