"""model.config validation edges that mutation testing found unchecked (references written out)."""

import dataclasses
import math

import pytest

from configs import horizon
from model import config as config_mod
from model.config import ConfigError, ModelConfig, with_runtime_overrides


def _model(**changes):
  m = horizon.get_config("tiny").model.to_dict()
  m.update(changes)
  return m


def _build(**changes):
  return ModelConfig.from_config(_model(**changes))


def _refused(field, **changes):
  with pytest.raises(ConfigError) as e:
    _build(**changes)
  assert str(e.value).startswith(f"config.model.{field}="), str(e.value)
  return str(e.value)


def test_layer_pattern_by_hand():
  """Layer i is Gated DSA when i % period == offset; the first num_dense_layers are dense."""
  cfg = _build(num_layers=7, dsa_period=3, dsa_offset=1, num_dense_layers=2)
  assert cfg.layer_kinds == ("delta", "dsa", "delta", "delta", "dsa", "delta", "delta")
  assert cfg.ffn_kinds == ("dense", "dense", "moe", "moe", "moe", "moe", "moe")
  assert _build(num_dense_layers=0).ffn_kinds == ("moe",) * 4
  assert _build(num_dense_layers=4).ffn_kinds == ("dense",) * 4  # every layer dense is allowed


@pytest.mark.parametrize("backend,kernels,want", [("gpu", "auto", True), ("tpu", "auto", True),
                                                  ("cpu", "auto", False), ("gpu", "xla", False),
                                                  ("cpu", "pallas", True)])
def test_use_pallas(monkeypatch, backend, kernels, want):
  monkeypatch.setattr(config_mod.jax, "default_backend", lambda: backend)
  assert _build(kernels=kernels).use_pallas is want


POSITIVE_INTS = ("vocab_size", "d_model", "num_layers", "dense_ffn_dim", "max_seq_len", "num_heads",
                 "q_lora_rank", "kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim", "index_heads",
                 "index_head_dim", "index_topk", "dsa_query_block", "dsa_key_block", "delta_qk_heads",
                 "delta_v_heads", "delta_qk_dim", "delta_v_dim", "delta_conv_size", "delta_chunk_size",
                 "num_experts", "experts_per_token", "expert_dim", "dsa_period")


@pytest.mark.parametrize("field", POSITIVE_INTS)
def test_every_size_field_refuses_zero(field):
  message = _refused(field, **{field: 0})
  assert message.startswith(f"config.model.{field}=0:")


@pytest.mark.parametrize("field", ("norm_eps", "rope_theta", "routed_scaling"))
@pytest.mark.parametrize("value", [0, float("inf"), True, "1.0"])
def test_positive_finite_numbers(field, value):
  assert "finite number > 0" in _refused(field, **{field: value})


@pytest.mark.parametrize("field,value", [
    ("dsa_offset", 2), ("dsa_offset", -1),  # dsa_period = 2
    ("num_dense_layers", 5), ("num_dense_layers", -1),  # num_layers = 4
    ("dsa_dense_len", -1), ("indexer_stage", "dense"),
    ("num_shared_experts", -1), ("router_score", "relu"),
    ("expert_exchange", "dense"), ("capacity_factor", 0.0), ("capacity_factor", -1.0),
    ("remat", "dots"), ("scan_layers", 1), ("kernels", "Pallas"), ("quantization", "mxfp4"),
    ("dtype", "float64"), ("param_dtype", "int8"), ("image_token_id", 331), ("image_token_id", -1),
])
def test_bad_value_is_refused_by_name(field, value):
  _refused(field, **{field: value})


def test_index_head_dim_may_equal_the_rope_dims():
  assert _build(index_head_dim=6).index_head_dim == 6  # qk_rope_dim = 6
  assert "even number" in _refused("qk_rope_dim", qk_rope_dim=7)
  assert "must be >= qk_rope_dim" in _refused("index_head_dim", index_head_dim=4)
  assert _build(dsa_dense_len=0).dsa_dense_len == 0
  assert _build(image_token_id=330).image_token_id == 330  # the last id of 331


def test_delta_heads_and_router_shape():
  assert _build(delta_qk_heads=2, delta_v_heads=6).delta_v_heads == 6
  _refused("delta_v_heads", delta_qk_heads=4, delta_v_heads=2)  # qk heads must divide v heads
  _refused("experts_per_token", experts_per_token=9, router_groups=1, router_topk_groups=1)
  _refused("router_groups", router_groups=3)  # 8 experts
  _refused("router_groups", router_groups=16)
  assert "must be in [1, router_groups=2]" in _refused("router_topk_groups", router_topk_groups=0)
  _refused("router_topk_groups", router_groups=2, router_topk_groups=3)
  # 8 experts in 4 groups of 2, best 1 group: 2 experts reachable, k=3 is not.
  message = _refused("router_topk_groups", router_groups=4, router_topk_groups=1, experts_per_token=3)
  assert "raise router_topk_groups" in message
  assert _build(router_groups=4, router_topk_groups=1, experts_per_token=2).experts_per_token == 2


def test_rope_wavelength_boundary():
  """tiny: qk_rope_dim 6, theta 1e4: longest wavelength 2 pi 1e4^(4/6) = 2916.4 positions."""
  assert _build(max_seq_len=2916).max_seq_len == 2916
  message = _refused("rope_theta", max_seq_len=2917)
  assert "2.92e+03 < max_seq_len=2917" in message


@pytest.mark.parametrize("field,value,fragment", [
    ("image_size", 18, "not a multiple of patch_size=4"), ("width", 21, "not divisible by num_heads=2"),
    ("num_channels", True, "must be a positive int"), ("width", 2.0, "must be a positive int"),
])
def test_vision_checks(field, value, fragment):
  m = _model()
  m["vision"] = dict(m["vision"], **{field: value})
  with pytest.raises(ConfigError, match=fragment) as e:
    ModelConfig.from_config(m)
  assert str(e.value).startswith(f"config.model.vision.{field}=")
  m["vision"]["enabled"] = False  # a disabled encoder is not checked
  assert not ModelConfig.from_config(m).vision.enabled


def test_missing_vision_field_and_replace_validates():
  m = _model()
  m["vision"] = {k: v for k, v in m["vision"].items() if k != "depth"}
  with pytest.raises(ConfigError, match=r"config.model.vision: missing field\(s\) \['depth'\]"):
    ModelConfig.from_config(m)
  with pytest.raises(ConfigError, match="config.model.remat"):
    _build().replace(remat="sometimes")


def test_runtime_overrides_refuse_changed_weights_and_keep_the_rest():
  cfg = _build()
  with pytest.raises(ConfigError, match=r"config.model.num_experts=16 \(ckpt has 8\)"):
    with_runtime_overrides(cfg, {"num_experts": 16, "kernels": "xla"}, "ckpt")
  with pytest.raises(ConfigError, match="MXFP4 weights come from"):
    with_runtime_overrides(cfg, {"quantization": "experts"}, "ckpt")
  out = with_runtime_overrides(cfg, {"capacity_factor": 3.0, "max_seq_len": 512}, "ckpt")
  assert dataclasses.asdict(out) == dict(dataclasses.asdict(cfg), capacity_factor=3.0, max_seq_len=512)
  with pytest.raises(ConfigError, match="config.model.capacity_factor"):
    with_runtime_overrides(cfg, {"capacity_factor": 0.0}, "ckpt")


def test_model_config_needs_a_model_section():
  with pytest.raises(ConfigError, match="has no `model` section"):
    config_mod.model_config(None)
  assert config_mod.model_config(horizon.get_config("tiny")).d_model == 56
  assert math.isclose(_build().norm_eps, 1e-6)


@pytest.mark.parametrize("field,value", [
    ("num_shared_experts", 1.5), ("num_dense_layers", 1.5), ("router_groups", 2.0),
    ("router_topk_groups", 1.0), ("dsa_offset", 1.0), ("image_token_id", 3.0), ("num_layers", True),
    ("num_shared_experts", True), ("dsa_dense_len", True), ("capacity_factor", float("inf")),
    ("capacity_factor", True), ("norm_topk_prob", "no"), ("norm_topk_prob", 0),
])
def test_counts_and_switches_need_their_type(field, value):
  """These were accepted: 1.5 shared experts were counted as 1.5 in the FLOPs, num_dense_layers 1.5
  made two dense layers, True one layer, norm_topk_prob 'no' normalised, an infinite capacity
  failed late in math.ceil."""
  _refused(field, **{field: value})


def test_vision_enabled_must_be_a_bool():
  m = _model()
  m["vision"] = dict(m["vision"], enabled="no")  # a non-empty string was truthy: the encoder ran
  with pytest.raises(ConfigError, match=r"config.model.vision.enabled='no': must be True or False"):
    ModelConfig.from_config(m)
