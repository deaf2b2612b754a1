"""Per-device training memory of a config on a mesh, without any devices.

    python -m experiments.memory_plan --config=configs/horizon.py:full \\
        --mesh=data=1,fsdp=32,expert=4,tensor=8 --global_batch=1024 --seq_len=4096 \\
        --micro_batches=8 --hbm_gib=95 --name=v5p-2048

    python -m experiments.memory_plan --config=configs/horizon.py:small --validate \\
        --global_batch=1 --seq_len=512

Prints a table of GiB per device (training/memory_plan.py says what each row
counts): parameters (exact, bf16 for `full`, and with MXFP4 routed experts),
AdamW state, gradients (+ accumulator with --micro_batches > 1), activations
of one micro-batch for the remat policy (an ANALYTIC ESTIMATE,
training/activation_memory.py), totals, and whether the total fits --hbm_gib
with 10% reserved. Last line: one JSON object with every number in bytes.

`--validate` compiles the real train step for a small config on one device of
this host and prints XLA's temp bytes next to the activation estimate, per
remat policy and per block kind; last line JSON. It takes only --config,
--global_batch and --seq_len, and refuses the other flags when they are given.
"""

from __future__ import annotations

import json

from absl import app, flags

from experiments.config_util import define_config_flag, run_app
from model.config import model_config
from training import activation_memory as am
from training import memory_plan as mp

_CONFIG = define_config_flag()
_MESH = flags.DEFINE_string("mesh", "data=1,fsdp=1,expert=1,tensor=1",
                            "Mesh axis sizes, e.g. 'data=1,fsdp=64,expert=8,tensor=1' (-1 needs --devices).")
_DEVICES = flags.DEFINE_integer("devices", None, "Device count (>= 1), to resolve a -1 axis of --mesh.")
_GLOBAL_BATCH = flags.DEFINE_integer("global_batch", None, "Sequences per optimizer step (all devices).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 4096, "Tokens per sequence.")
_MICRO = flags.DEFINE_integer("micro_batches", 1, "Gradient-accumulation steps per optimizer step.")
_REMAT = flags.DEFINE_enum("remat", None, mp.REMATS, "Remat policy (default: the config's).")
_HBM = flags.DEFINE_float("hbm_gib", None, "Device memory in GiB (95: TPU v5p, 141: H200).")
_OPTIMIZER = flags.DEFINE_enum("optimizer", "adamw", ["adamw"], "adamw: mu and nu in f32 per parameter.")
_BACKEND = flags.DEFINE_enum("backend", "tpu", list(am.BACKENDS),
                             "Target backend: picks the MoE matmul and the 'auto' expert exchange.")
_EXCHANGE = flags.DEFINE_enum("exchange", None, ["auto", "ragged", "capacity"],
                              "Expert-parallel exchange (default: the config's expert_exchange).")
_NAME = flags.DEFINE_string("name", "", "A label for this row (e.g. the cluster).")
_VALIDATE = flags.DEFINE_bool("validate", False, "Compare the activation estimate with XLA's temp "
                              "bytes of the compiled train step (and of each block kind) on one "
                              "device of this host, for --global_batch sequences of --seq_len "
                              "(tiny/small configs; takes only --config, --global_batch and --seq_len).")
# What --validate does not read: given with it, they are refused rather than ignored.
_PLAN_ONLY = (_MESH, _DEVICES, _MICRO, _REMAT, _HBM, _OPTIMIZER, _BACKEND, _EXCHANGE, _NAME)


def main(argv):
  del argv  # (run_app refuses stray positional arguments: `--validate false`)
  cfg = model_config(_CONFIG.value)
  if _GLOBAL_BATCH.value is None:
    raise app.UsageError("--global_batch is required (sequences per optimizer step).")
  if _VALIDATE.value:
    given = [f"--{f.name}" for f in _PLAN_ONLY if flags.FLAGS[f.name].present]
    if given:
      raise app.UsageError(f"--validate does not use {', '.join(given)} (it compiles the config on one "
                           "device of this host, for every remat policy); drop them, or drop --validate "
                           "for the memory plan.")
    text, numbers = mp.validate_report(cfg, _GLOBAL_BATCH.value, _SEQ_LEN.value)
    print(text)
    print(json.dumps(numbers))
    return
  res = mp.plan(cfg, mp.mesh_shape_from_flags(_MESH.value, _DEVICES.value), global_batch=_GLOBAL_BATCH.value,
                seq_len=_SEQ_LEN.value, micro_batches=_MICRO.value, remat=_REMAT.value,
                backend=_BACKEND.value, exchange=_EXCHANGE.value, hbm_gib=_HBM.value)
  res["name"] = _NAME.value
  res["config"] = _CONFIG.value.variant if "variant" in _CONFIG.value else ""
  print(mp.format_table(res, _NAME.value))
  print(json.dumps(res))


if __name__ == "__main__":
  run_app(main)
