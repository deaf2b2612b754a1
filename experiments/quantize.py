"""Converts a dense checkpoint to one with MXFP4 (OCP MX v1.0) weights; prints what it did.

    python -m experiments.quantize --checkpoint=/tmp/run/checkpoints --out=/tmp/run_mxfp4
    python -m experiments.quantize --checkpoint=IN --out=OUT --what=all-linear --eval_tokens=32768

--what=experts (default) stores the routed experts' w_gate/w_up/w_down as
MXFP4 blocks + E8M0 scales (gpt-oss layout, see model/quant.py); all-linear
also every other linear weight of the language model. Each tensor is
quantized or kept dense with a reason (e.g. no axis of a multiple of 32, as
in `tiny`; the lightning indexer; the embedding): the table on stdout has one
row per tensor group (layers merged) with shape, bits per weight and bytes
before/after, then totals and a last line of JSON. --eval_tokens=N adds the
held-out loss before and after (training/quantize.py says which text).

The output is a normal Horizon checkpoint (params + meta, no optimizer state)
whose stored config says `model.quantization`, so `training.checkpoint.load_model`,
`experiments.serve` and `serving.build.build_engine` load it like any other.
Nothing partial is ever left at --out.
"""

from __future__ import annotations

import json

from absl import app, flags, logging
from ml_collections import config_flags

from experiments.config_util import run_app
from training.quantize import convert, table

_IN = flags.DEFINE_string("checkpoint", None, "Input checkpoint directory (dense weights).")
_OUT = flags.DEFINE_string("out", None, "Output checkpoint directory (must not exist or be empty).")
_WHAT = flags.DEFINE_enum("what", "experts", ["experts", "all-linear"], "Which weights to quantize.")
_MODE = flags.DEFINE_enum("mode", "floor", ["floor", "ceil"],
                          "E8M0 scale rule: floor = the OCP spec's (saturates the top of the "
                          "range), ceil = never clips.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to convert (default: the latest).")
_EVAL = flags.DEFINE_integer("eval_tokens", 0, "Held-out tokens to measure the loss on before and "
                             "after quantizing (0: skip).")
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config for checkpoints that store none (its model section is used).",
    lock_config=False)


def main(argv):
  del argv
  if not _IN.value or not _OUT.value:
    raise app.UsageError("--checkpoint and --out are required.")
  done = convert(_IN.value, _OUT.value, _WHAT.value, _MODE.value, _STEP.value, _CONFIG.value,
                 eval_tokens=_EVAL.value)
  logging.info("wrote %s", done.summary["out"])
  print(table(done.decisions))
  h = done.summary.get("heldout")
  if h:
    print(f"held-out loss over {h['tokens']:,} tokens: {h['loss_before']:.4f} dense -> "
          f"{h['loss_after']:.4f} MXFP4 ({h['delta']:+.4f} nats/token)")
  print(json.dumps(done.summary))


if __name__ == "__main__":
  run_app(main)
