"""training/memory_plan.py (+ activation_memory.py): exact state bytes, the activation estimate vs XLA,
and the experiments/memory_plan.py CLI."""

import json
import math
import os
import subprocess
import sys

import pytest
from flax import nnx

from configs import horizon
from model.config import ModelConfig
from model.decoder import abstract_model
from model.param_count import count_parameters
from sharding.mesh import MeshError
from sharding.rules import ShardingError
from training import activation_memory as am
from training import memory_plan as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE = {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}


def _cfg(variant: str) -> ModelConfig:
  return ModelConfig.from_config(horizon.get_config(variant).model)


@pytest.fixture(scope="module")
def full():
  cfg = _cfg("full")
  return cfg, nnx.split(abstract_model(cfg))[1]


def test_one_device_param_bytes_match_param_count(full):
  cfg, state = full
  sb = mp.state_bytes(cfg, ONE, state=state)
  n = count_parameters(cfg)["total_with_vision"]
  # bf16 everywhere except the delta layers' f32 A_log and dt_bias (one per value head);
  # RouterBias (f32, one per expert per MoE layer) is state but not a parameter.
  n_f32 = cfg.layer_kinds.count("delta") * 2 * cfg.delta_v_heads
  n_bias = cfg.ffn_kinds.count("moe") * cfg.num_experts
  assert sb["param_count"] == n
  assert sb["router_bias"] == 4 * n_bias
  assert sb["params"] == 2 * n + 2 * n_f32 + 4 * n_bias
  assert sb["optimizer"] == 8 * n
  assert sb["gradients"] == 2 * n + 2 * n_f32


def test_split_weights_divide_by_their_shards(full):
  cfg, state = full
  mesh = {"data": 2, "fsdp": 16, "expert": 8, "tensor": 4}
  sb = mp.state_bytes(cfg, mesh, state=state)
  experts = cfg.ffn_kinds.count("moe") * 3 * cfg.num_experts * cfg.d_model * cfg.expert_dim
  # Routed experts [e, d, f] are split over expert x fsdp x tensor (not data).
  assert sb["routed_experts"] == 2 * experts / (8 * 16 * 4)
  one = mp.state_bytes(cfg, ONE, state=state)
  assert one["routed_experts"] == 2 * experts
  # MXFP4 column: experts at 4.25 bits/element, the rest unchanged.
  assert sb["params_mxfp4"] == pytest.approx(sb["params"] - sb["routed_experts"]
                                             + experts / (8 * 16 * 4) * 4.25 / 8)
  # Every weight is split at most 8 * 16 * 4 ways and at least not at all.
  assert one["params"] / 512 < sb["params"] < one["params"]


def test_micro_batching_adds_a_gradient_accumulator(full):
  cfg, state = full
  mesh = {"data": 1, "fsdp": 32, "expert": 4, "tensor": 8}
  one, two = (mp.state_bytes(cfg, mesh, m, state=state) for m in (1, 2))
  assert two["gradients"] == 2 * one["gradients"]
  assert two["optimizer"] == one["optimizer"]


def test_bad_mesh_names_the_weight():
  cfg = _cfg("tiny")
  with pytest.raises(ShardingError, match=r"\['ffn'\].*'expert'"):
    mp.state_bytes(cfg, {"data": 1, "fsdp": 1, "expert": 3, "tensor": 1})


def test_indivisible_batch_names_the_flags():
  with pytest.raises(ValueError, match="--global_batch=12.*--micro_batches=2"):
    mp.local_batch(12, 2, {"data": 1, "fsdp": 2, "expert": 2, "tensor": 4})
  assert mp.local_batch(16, 2, {"data": 1, "fsdp": 2, "expert": 2, "tensor": 4}) == 2


def test_activation_estimate_orders_remat_policies():
  cfg = _cfg("full")
  loc = am.Local(seqs=1, seq_len=4096, tensor=8, expert=4, fsdp=32, backend="tpu", exchange="capacity")
  acts = {r: am.model_activation_bytes(cfg, loc, r)["total"] for r in mp.REMATS}
  assert acts["full"] < acts["save_dots"] < acts["none"]
  # The ragged exchange's worst-case receive buffer (ep * A rows) costs more than capacity buckets.
  ragged = am.model_activation_bytes(cfg, am.Local(1, 4096, 8, 4, 32, "tpu", "ragged"), "full")
  assert ragged["total"] > acts["full"]


def test_estimate_within_2x_of_xla_for_small():
  """The activation estimate vs XLA's planned temp bytes of the compiled small train step.

  remat 'none' only: XLA:CPU plans the same temp bytes for every remat policy
  (see the memory_plan module docstring), so the other policies are not
  comparable on this backend.
  """
  cfg = _cfg("small")
  res = mp.validate(cfg, batch=1, seq_len=512, remats=("none",))["none"]
  assert 0.5 <= res["ratio"] <= 2.0, res


@pytest.mark.parametrize("seq_len,dense_len", [(256, 0), (512, 512)])
def test_block_estimate_within_2x_of_xla_for_small(seq_len, dense_len):
  """One block's forward + backward: the term the 'full' policy's peak is made of. At 256 tokens
  small's top-256 covers every key (dense MQA); at 512 with dsa_dense_len=512 the sparse stage
  runs as dense MQA under the top-k mask."""
  blocks = mp.validate_blocks(_cfg("small").replace(dsa_dense_len=dense_len), batch=2, seq_len=seq_len)
  assert set(blocks) == {"dsa+dense", "dsa+moe", "delta+moe"}
  for name, res in blocks.items():
    assert 0.5 <= res["ratio"] <= 2.0, (name, res)


def test_cli_prints_table_and_json_last_line():
  cmd = [sys.executable, "-m", "experiments.memory_plan", "--config=configs/horizon.py:tiny_sharded",
         "--mesh=data=2,fsdp=2,expert=2,tensor=1", "--global_batch=16", "--seq_len=64",
         "--micro_batches=2", "--hbm_gib=1", "--name=test"]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
  assert "optimizer (AdamW mu+nu f32)" in out and "analytic estimate" in out
  res = json.loads(out.strip().splitlines()[-1])
  b = res["bytes"]
  assert res["local_seqs"] == 1 and res["local_tokens"] == 64 and res["fits"] is True
  assert b["total"] == pytest.approx(b["params"] + b["optimizer"] + b["gradients"] + b["activations"])
  assert math.isclose(res["usable_bytes"], 0.9 * 2 ** 30)


def test_validate_refuses_configs_too_big_for_this_host():
  with pytest.raises(ValueError, match=r"--validate skipped: needs \d+\.\d GiB"):
    mp.check_validate_size(_cfg("full"), batch=1, seq_len=128)


def test_validate_report_tables_every_policy_and_block(monkeypatch):
  """The --validate table and JSON (the compiles themselves are the two tests above)."""
  row = {"xla_temp": 2 ** 21, "estimate": 2 ** 20, "ratio": 0.5}
  monkeypatch.setattr(mp, "validate", lambda cfg, batch, seq_len: dict.fromkeys(mp.REMATS, row))
  monkeypatch.setattr(mp, "validate_blocks", lambda cfg, batch, seq_len: dict.fromkeys(
      ("dsa+dense", "delta+moe", "dsa+moe"), row))
  text, numbers = mp.validate_report(_cfg("tiny"), batch=1, seq_len=32)
  assert set(numbers["validate"]) == set(mp.REMATS) and numbers["batch"] == 1 and numbers["seq_len"] == 32
  assert set(numbers["blocks"]) == {"dsa+dense", "delta+moe", "dsa+moe"}
  lines = text.splitlines()
  assert lines[0].startswith("validate: batch 1 x 32") and "est/XLA" in lines[1]
  assert [line.split()[0] for line in lines[2:5]] == list(mp.REMATS)
  assert lines[2].split()[1:] == ["2.0", "1.0", "0.50"]  # MiB, MiB, ratio
  assert sum(line.startswith("block ") for line in lines) == 3
  json.dumps(numbers)  # the launcher's last line


def test_devices_below_one_names_the_flag():
  """--devices=0 filled the -1 axis with 0 (ZeroDivisionError later); -4 failed naming Local's seqs."""
  for n in (0, -4):
    with pytest.raises(ValueError, match=f"^--devices={n} must be a positive device count"):
      mp.mesh_shape_from_flags("data=1,fsdp=-1,expert=1,tensor=1", n)
  with pytest.raises(ValueError, match="^--devices=0"):  # not '1 devices but 0 are available'
    mp.mesh_shape_from_flags("data=1,fsdp=1,expert=1,tensor=1", 0)
  with pytest.raises(MeshError, match=r"^--mesh='data=3,fsdp=-1' \(--devices=8\) .*does not divide 8"):
    mp.mesh_shape_from_flags("data=3,fsdp=-1", 8)
  with pytest.raises(MeshError, match=r"^--mesh='data=0,fsdp=-1': axis size data=0"):
    mp.mesh_shape_from_flags("data=0,fsdp=-1", 8)
  assert mp.mesh_shape_from_flags("data=2,fsdp=-1", 8) == {"data": 2, "fsdp": 4, "expert": 1, "tensor": 1}


@pytest.mark.parametrize("batch,seq_len,match", [
    (0, 32, "^--global_batch=0 must be a positive integer"),
    (-2, 32, "^--global_batch=-2 must be a positive integer"),
    (1, 0, r"^--seq_len=0 must be in \[1, "),
    (1, 100_000, r"^--seq_len=100000 must be in \[1, config.model.max_seq_len=256\]"),
])
def test_validate_refuses_bad_batch_and_seq_len_before_compiling(batch, seq_len, match, monkeypatch):
  """--validate compiled tiny at 100000 tokens (max_seq_len 256) and failed naming Local's seqs for
  --global_batch=0; it now checks what plan() checks, by flag, before any compile."""
  def compiled(*args):
    raise AssertionError("compiled before checking the flags")

  monkeypatch.setattr(mp, "compiled_train_step_temp", compiled)
  monkeypatch.setattr(mp, "compiled_block_temp", compiled)
  cfg = _cfg("tiny")
  with pytest.raises(ValueError, match=match):
    mp.validate(cfg, batch, seq_len)
  with pytest.raises(ValueError, match=match):
    mp.validate_blocks(cfg, batch, seq_len)
  with pytest.raises(ValueError, match=match):
    mp.plan(cfg, ONE, global_batch=batch, seq_len=seq_len)


# The CLI's own checks, each run in-process by one driver (the flags are absl globals, kept out of
# pytest's process); a compile would mean a check did not fire.
_CLI_DRIVER = """
import json, sys
from absl import flags
from experiments import memory_plan as cli
from training import memory_plan as mp
def compiled(*args):
  raise RuntimeError("compiled")
mp.compiled_train_step_temp = mp.compiled_block_temp = compiled
for name, args in json.loads(sys.argv[1]).items():
  argv = flags.FLAGS(["memory_plan", "--config=configs/horizon.py:tiny", *args])
  try:
    cli.main(argv)
    print(name, "| ran")
  except Exception as e:
    print(name, "|", type(e).__name__, e)
  flags.FLAGS.unparse_flags()
"""


def test_cli_refuses_flags_validate_ignores():
  cases = {
      "unused": ["--validate", "--global_batch=1", "--seq_len=32", "--micro_batches=7", "--hbm_gib=-1",
                 "--remat=full", "--backend=gpu", "--exchange=capacity", "--name=X", "--mesh=data=1",
                 "--devices=1"],
      "defaults_given": ["--validate", "--global_batch=1", "--seq_len=32", "--optimizer=adamw"],
      "seq_len": ["--validate", "--global_batch=1", "--seq_len=100000"],
      "devices": ["--mesh=data=1,fsdp=-1,expert=1,tensor=1", "--devices=0", "--global_batch=4",
                  "--seq_len=64"],
  }
  out = subprocess.run([sys.executable, "-c", _CLI_DRIVER, json.dumps(cases)], cwd=ROOT, capture_output=True,
                       text=True, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
  got = dict(line.split(" | ", 1) for line in out.strip().splitlines() if " | " in line)
  assert got["unused"] == ("UsageError --validate does not use --mesh, --devices, --micro_batches, --remat, "
                           "--hbm_gib, --backend, --exchange, --name (it compiles the config on one device "
                           "of this host, for every remat policy); drop them, or drop --validate for the "
                           "memory plan."), got
  assert got["defaults_given"].startswith("UsageError --validate does not use --optimizer ("), got
  assert got["seq_len"].startswith("ConfigError --seq_len=100000 must be in [1, "), got
  assert got["devices"].startswith("ConfigError --devices=0 must be a positive device count"), got
