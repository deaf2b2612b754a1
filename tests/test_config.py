"""Every config file and variant parses, validates and builds abstractly."""

import dataclasses
import glob
import importlib
import json
import os
import re
import subprocess
import sys

import jax
import pytest
from flax import nnx

from configs import horizon
from model.config import ConfigError, ModelConfig
from model.decoder import abstract_model
from model.param_count import count_parameters

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _all_configs():
  for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))):
    name = os.path.basename(path)[:-3]
    if name == "__init__":
      continue
    mod = importlib.import_module(f"configs.{name}")
    for variant in getattr(mod, "VARIANTS", ("",)):
      yield name, variant


@pytest.mark.parametrize("name,variant", list(_all_configs()))
def test_every_config_builds_abstractly(name, variant):
  cfg = ModelConfig.from_config(importlib.import_module(f"configs.{name}").get_config(variant).model)
  model = abstract_model(cfg)
  params = nnx.state(model, nnx.Param)
  leaves = jax.tree.leaves(params)
  assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  assert len(model.blocks) == cfg.num_layers
  # Every parameter carries one logical axis name per dimension.
  for path, var in nnx.to_flat_state(params):
    axes = var.get_metadata().get("axes")
    assert axes is not None and len(axes) == len(var.get_value().shape), path


def test_tiny_meets_test_requirements(tiny_cfg):
  kinds = tiny_cfg.layer_kinds
  assert tiny_cfg.num_layers >= 4 and "dsa" in kinds and "delta" in kinds
  assert tiny_cfg.num_experts >= 8 and "dense" in tiny_cfg.ffn_kinds and "moe" in tiny_cfg.ffn_kinds
  assert tiny_cfg.index_topk <= 16
  assert count_parameters(tiny_cfg)["total_with_vision"] <= 5_000_000


def test_small_size():
  cfg = ModelConfig.from_config(horizon.get_config("small").model)
  assert 30e6 <= count_parameters(cfg)["total_with_vision"] <= 100e6


def test_full_matches_design_targets():
  cfg = ModelConfig.from_config(horizon.get_config("full").model)
  res = count_parameters(cfg)
  assert res["layers"] == {"dsa": 24, "delta": 69}
  assert cfg.num_layers == 93 and cfg.index_topk == 2048 and cfg.max_seq_len == 1_048_576
  assert abs(res["total"] / 2.80e12 - 1) <= 0.01, res["total"]
  assert abs(res["active"] / 104e9 - 1) <= 0.01, res["active"]
  assert all(n > 0 for n in res["components"].values()), res["components"]


def test_param_count_cli_last_line_is_json():
  out = subprocess.run([sys.executable, "-m", "experiments.param_count",
                        "--config=configs/horizon.py:tiny"], cwd=ROOT, capture_output=True,
                       text=True, check=True).stdout
  last = json.loads(out.strip().splitlines()[-1])
  assert last["layers"] == {"dsa": 2, "delta": 2} and last["total"] > last["active"] > 0


def test_a_typo_in_an_override_is_one_line_with_the_suggestion():
  """It was a 55-line traceback with ml_collections' suggestion in the middle."""
  cmd = [sys.executable, "-m", "experiments.param_count", "--config=configs/horizon.py:tiny",
         "--config.model.num_layer=3"]
  run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert run.returncode == 1 and "Traceback" not in run.stderr
  assert "FATAL flags error: 'num_layer' Did you mean \"num_layers\" instead of \"num_layer\"?" in run.stderr
  assert "--config.model.num_layer=3" in run.stderr


def test_an_unknown_variant_is_one_line_with_the_choices():
  """absl printed the config file's traceback, embedded in its flag error, 10 lines of it."""
  cmd = [sys.executable, "-m", "experiments.param_count", "--config=configs/horizon.py:tinny"]
  run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
  assert ("FATAL flags error: flag --config=configs/horizon.py:tinny: Error whilst parsing config file: "
          "ValueError: configs/horizon.py: unknown variant 'tinny'; choose one of") in run.stderr, run.stderr


@pytest.mark.parametrize("field,value,fragment", [
    ("delta_v_heads", 3, "multiple of delta_qk_heads"),
    ("router_groups", 3, "must divide num_experts"),
    ("rope_theta", 10.0, "raise rope_theta"),
    ("experts_per_token", 99, "experts_per_token"),
    ("remat", "sometimes", "remat"),
    ("norm_eps", -1.0, "finite number > 0"),  # every logit was NaN, named as a tensor at step 0
    ("norm_eps", 0.0, "finite number > 0"),
    ("routed_scaling", 0.0, "0 would switch them off"),
    ("routed_scaling", float("nan"), "finite number > 0"),
    ("rope_theta", -10000.0, "finite number > 0"),  # was a TypeError about complex numbers
])
def test_bad_values_name_the_field(field, value, fragment):
  c = horizon.get_config("tiny")
  c.model[field] = value
  with pytest.raises(ConfigError, match=fragment) as e:
    ModelConfig.from_config(c.model)
  assert f"config.model.{field}" in str(e.value)


def test_missing_and_unknown_fields():
  c = horizon.get_config("tiny").model.to_dict()
  del c["d_model"]
  with pytest.raises(ConfigError, match="missing field.*d_model"):
    ModelConfig.from_config(c)
  c = horizon.get_config("tiny").model.to_dict()
  c["d_modle"] = 3
  with pytest.raises(ConfigError, match="unknown field.*d_modle"):
    ModelConfig.from_config(c)


def test_unknown_variant():
  with pytest.raises(ValueError, match="unknown variant"):
    horizon.get_config("huge")


@pytest.mark.parametrize("field,value", [("patch_size", 0), ("num_heads", 0), ("mlp_dim", -4), ("depth", 0),
                                         ("image_size", 0)])
def test_bad_vision_values_name_the_field(field, value):
  """patch_size / num_heads 0 were a ZeroDivisionError, mlp_dim < 0 a deep JAX shape error."""
  c = horizon.get_config("tiny")
  assert c.model.vision.enabled
  c.model.vision[field] = value
  message = f"config.model.vision.{field}={value!r}: must be a positive int"
  with pytest.raises(ConfigError, match=re.escape(message)):
    ModelConfig.from_config(c.model)


def test_with_runtime_overrides():
  """A checkpoint's config takes command-line runtime fields; fields the weights fix are refused by
  name when they differ (nested ones too) and accepted when they agree."""
  from model.config import RUNTIME_FIELDS, with_runtime_overrides
  cfg = ModelConfig.from_config(horizon.get_config("tiny").model)
  assert with_runtime_overrides(cfg, {}, "ckpt") is cfg
  out = with_runtime_overrides(cfg, {"delta_chunk_size": 8, "remat": "none", "num_layers": cfg.num_layers},
                               "ckpt")
  assert (out.delta_chunk_size, out.remat, out.num_layers) == (8, "none", cfg.num_layers)
  assert dataclasses.replace(out, delta_chunk_size=cfg.delta_chunk_size, remat=cfg.remat) == cfg
  with pytest.raises(ConfigError, match=r"num_layers=9 \(ckpt has 4\).*vision.image_size=7 \(ckpt has "):
    with_runtime_overrides(cfg, {"num_layers": 9, "vision.image_size": 7}, "ckpt")
  with pytest.raises(ConfigError, match="config.model.remat"):  # a bad runtime value is still checked
    with_runtime_overrides(cfg, {"remat": "some"}, "ckpt")
  assert "dtype" in RUNTIME_FIELDS and "d_model" not in RUNTIME_FIELDS
  # a misspelt field compared equal to itself and was dropped silently
  with pytest.raises(ConfigError, match=r"model.num_layer, config.model.vision.size: no such model field"):
    with_runtime_overrides(cfg, {"num_layer": 9, "vision.size": 7, "num_layers": cfg.num_layers}, "ckpt")
  with pytest.raises(ConfigError, match=r"config.model.num_layers.x: no such model field"):
    with_runtime_overrides(cfg, {"num_layers.x": 1}, "ckpt")


def test_model_overrides_reads_the_command_line(monkeypatch):
  """experiments.config_util.model_overrides: the --config.model.* fields given, nested ones dotted."""
  from absl import flags
  from ml_collections import config_flags

  from experiments.config_util import model_overrides
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, flag_values=fv, lock_config=True)
  argv = ["prog", "--config=" + os.path.join(ROOT, "configs", "serve.py") + ":tiny",
          "--config.model.kernels=xla", "--config.serving.slots=3", "--config.model.vision.depth=2"]
  monkeypatch.setattr(sys, "argv", argv)  # ml_collections reads the overrides from sys.argv
  fv(argv)
  assert model_overrides(flag_values=fv) == {"kernels": "xla", "vision.depth": 2}
