"""sharding/rules.py, mesh.py, state.py edge cases that mutation testing found unchecked (expected
specs and sizes written out by hand; 8 fake CPU devices from conftest)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from model.quant import MXFP4Weight, quantize_model
from sharding import mesh as mesh_lib
from sharding import rules as rules_lib
from sharding.state import create_sharded_model, shard_model

NO_FSDP = rules_lib.DEFAULT_RULES.replace(params={"embed": None})
MESH_SHAPE = {"data": 1, "fsdp": 2, "expert": 1, "tensor": 4}


class _Lin(nnx.Module):
  """One [embed=8, mlp=4] weight."""

  def __init__(self, rngs: nnx.Rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 4)), axes=("embed", "mlp"))


class _Experts(nnx.Module):
  """A routed-expert-like weight [expert=4, embed=64, mlp=mlp] (blocked along embed)."""

  def __init__(self, mlp: int):
    w = np.random.default_rng(0).standard_normal((4, 64, mlp)).astype(np.float32)
    self.w = nnx.Param(jnp.asarray(w), axes=("expert", "embed", "mlp"))


def _spec(state_specs) -> P:
  return state_specs["w"].get_value()


def test_replace_overrides_only_the_named_entries_of_its_column():
  base = rules_lib.DEFAULT_RULES
  r = base.replace(params={"embed": None})
  assert r.params["embed"] is None and r.params["mlp"] == "tensor" and r.params["expert"] == "expert"
  assert dict(r.activations) == dict(base.activations) and base.params["embed"] == "fsdp"
  a = base.replace(activations={"batch": ("data",)})
  assert a.batch_axes == ("data",) and dict(a.params) == dict(base.params)
  assert a.activations["heads"] == "tensor"


def test_use_rules_is_scoped_and_restores_the_previous_rules():
  assert rules_lib.current_rules() is rules_lib.DEFAULT_RULES
  with rules_lib.use_rules(NO_FSDP):
    assert rules_lib.current_rules() is NO_FSDP
  assert rules_lib.current_rules() is rules_lib.DEFAULT_RULES
  with pytest.raises(RuntimeError), rules_lib.use_rules(NO_FSDP):
    raise RuntimeError("boom")
  assert rules_lib.current_rules() is rules_lib.DEFAULT_RULES


def test_state_specs_and_activation_spec_read_the_current_rules():
  state = nnx.state(_Lin(nnx.Rngs(0)))
  assert _spec(rules_lib.state_specs(state, MESH_SHAPE)) == P("fsdp", "tensor")
  with rules_lib.use_rules(NO_FSDP):
    assert _spec(rules_lib.state_specs(state, MESH_SHAPE)) == P(None, "tensor")
  assert _spec(rules_lib.state_specs(state, MESH_SHAPE, NO_FSDP)) == P(None, "tensor")
  only_data = rules_lib.DEFAULT_RULES.replace(activations={"batch": "data"})
  shape = {"data": 2, "fsdp": 2, "expert": 2, "tensor": 1}
  assert rules_lib.activation_spec(("batch", "length"), (8, 3), shape) == P(("data", "fsdp", "expert"), None)
  assert rules_lib.activation_spec(("batch", "length"), (8, 3), shape, only_data) == P("data", None)
  with rules_lib.use_rules(only_data):
    assert rules_lib.activation_spec(("batch", "length"), (8, 3), shape) == P("data", None)
  # 12 rows over 8 batch shards: an uneven split, so the batch dim stays whole.
  assert rules_lib.activation_spec(("batch", "length"), (12, 3), shape) == P(None, None)
  assert rules_lib.activation_spec(("batch", "length"), (16, 3), shape) == P(("data", "fsdp", "expert"), None)


def test_mxfp4_weight_specs_follow_its_storage_axes():
  """[expert, embed=K, mlp] stored as blocks [expert, mlp, K/32, 16] and scales [expert, mlp, K/32]."""
  m = _Experts(mlp=8)
  quantize_model(m, "all-linear")
  assert isinstance(m.w, MXFP4Weight) and m.w.blocks.shape == (4, 8, 2, 16)
  specs = rules_lib.state_specs(nnx.state(m), {"data": 1, "fsdp": 1, "expert": 2, "tensor": 4})
  got = specs["w"].get_value()
  assert got == {"blocks": P("expert", "tensor", None, None), "scales": P("expert", "tensor", None)}


def test_mxfp4_weight_with_an_indivisible_packed_dim_is_a_clear_error():
  m = _Experts(mlp=6)
  quantize_model(m, "all-linear")
  with pytest.raises(rules_lib.ShardingError,
                     match=r"\['w'\]\[blocks\]: dim 1 \('mlp'\) of size 6 is split over mesh axes "
                           r"\('tensor',\) of total size 4"):
    rules_lib.state_specs(nnx.state(m), {"data": 1, "fsdp": 1, "expert": 2, "tensor": 4})


def test_divisibility_error_names_the_offending_dim_and_the_fix():
  spec = P("expert", "tensor", "fsdp")
  mesh_shape = {"data": 1, "expert": 2, "tensor": 4, "fsdp": 2}
  with pytest.raises(rules_lib.ShardingError) as e:
    rules_lib.check_divisible("param w", (8, 6, 4), spec, mesh_shape, ("expert", "mlp", "embed"))
  msg = str(e.value)
  assert msg.startswith("param w: dim 1 ('mlp') of size 6 is split over mesh axes ('tensor',)")
  assert "multiple of 4" in msg and "map that logical axis to None" in msg
  # A spec shorter than the shape leaves the trailing dims whole; a 2-way split of 3 is uneven.
  rules_lib.check_divisible("w", (8, 5), P("tensor"), {"tensor": 4})
  with pytest.raises(rules_lib.ShardingError, match="dim 0 of size 3"):
    rules_lib.check_divisible("w", (3,), P("tensor"), {"tensor": 2})
  with pytest.raises(rules_lib.ShardingError, match=r"dim 0 of size 6 .*\('data', 'fsdp'\) of total size 4"):
    rules_lib.check_divisible("w", (6,), P(("data", "fsdp")), {"data": 2, "fsdp": 2})


def test_variable_without_axes_is_a_sharding_error():
  class Bare(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones((4, 4)))

  with pytest.raises(rules_lib.ShardingError, match=r"\['w'\]: has no `axes` metadata"):
    rules_lib.state_specs(nnx.state(Bare()), MESH_SHAPE)


def test_axes_naming_more_dims_than_the_shape_is_a_sharding_error():
  """Three names for a 2-D weight (or a bare string) used to end in zip()'s ValueError, unnamed."""
  class Odd(nnx.Module):
    def __init__(self, axes):
      self.w = nnx.Param(jnp.ones((8, 4)), axes=axes)

  for axes in (("embed", "mlp", "heads"), "embed"):
    want = (r"param \[.w.\]: axes=.* is not a tuple of one logical name \(or None\) per dim of its "
            r"shape \(8, 4\)")
    with pytest.raises(rules_lib.ShardingError, match=want):
      rules_lib.state_specs(nnx.state(Odd(axes)), MESH_SHAPE)


def test_per_device_bytes_rounds_each_dim_up():
  assert rules_lib.per_device_bytes((10, 6), 2, P("tensor", None), {"tensor": 4}) == 3 * 6 * 2
  assert rules_lib.per_device_bytes((10,), 4, P(("data", "fsdp")), {"data": 2, "fsdp": 2}) == 3 * 4
  assert rules_lib.per_device_bytes((7, 9), 1, P(), {"tensor": 4}) == 63


def test_constrain_refuses_a_wrong_number_of_names():
  mesh = mesh_lib.make_mesh({"data": 8, "fsdp": 1, "expert": 1, "tensor": 1})
  x = jnp.ones((8, 3, 2))
  with mesh_lib.activate(mesh):
    for names in (("batch", "length"), ("batch", "length", "embed", "embed")):
      with pytest.raises(rules_lib.ShardingError, match=r"constrain: .* logical names"):
        jax.jit(lambda x, names=names: rules_lib.constrain(x, names))(x)


def test_mesh_config_rejects_bools_missing_axes_and_short_lists():
  with pytest.raises(mesh_lib.MeshError, match=r"config.mesh.data=True: must be a positive int"):
    mesh_lib.MeshConfig.from_config({"data": True, "fsdp": 1, "expert": 1, "tensor": 1})
  with pytest.raises(mesh_lib.MeshError, match=r"missing axes \['expert', 'fsdp', 'tensor'\]"):
    mesh_lib.MeshConfig.from_config({"data": 8})
  with pytest.raises(mesh_lib.MeshError, match=r"--mesh='2,4': give 4 sizes"):
    mesh_lib.MeshConfig.parse("2,4")
  with pytest.raises(mesh_lib.MeshError, match="at least 1 device, got num_devices=True"):
    mesh_lib.MeshConfig(1, 1, 1, 1).resolve(True)
  cfg = mesh_lib.MeshConfig.from_config({"data": np.int64(2), "fsdp": -1, "expert": 1, "tensor": 2})
  assert cfg.resolve(np.int64(8)) == (2, 2, 1, 2)
  assert all(type(v) is int for v in dataclasses.astuple(cfg))  # numpy ints stored as int (JSON-able)
  assert mesh_lib.MeshConfig.parse(" tensor = 2 ").resolve(2) == (1, 1, 1, 2)


def test_activate_makes_the_given_rules_current():
  mesh = mesh_lib.make_mesh({"data": 1, "fsdp": 2, "expert": 1, "tensor": 4})
  with mesh_lib.activate(mesh, NO_FSDP):
    assert rules_lib.current_rules() is NO_FSDP
  with mesh_lib.activate(mesh):
    assert rules_lib.current_rules() is rules_lib.DEFAULT_RULES


def test_create_and_shard_model_use_the_given_or_current_rules():
  mesh = mesh_lib.make_mesh(MESH_SHAPE)
  build = lambda: _Lin(nnx.Rngs(0))  # noqa: E731
  assert create_sharded_model(build, mesh).w[...].sharding.spec == P("fsdp", "tensor")
  assert create_sharded_model(build, mesh, NO_FSDP).w[...].sharding.spec == P(None, "tensor")
  with rules_lib.use_rules(NO_FSDP):
    assert create_sharded_model(build, mesh).w[...].sharding.spec == P(None, "tensor")
  assert shard_model(build(), mesh, NO_FSDP).w[...].sharding.spec == P(None, "tensor")
  with rules_lib.use_rules(NO_FSDP):
    assert shard_model(build(), mesh).w[...].sharding.spec == P(None, "tensor")
  got = shard_model(build(), mesh).w[...]
  assert got.sharding.spec == P("fsdp", "tensor")
  assert {s.data.shape for s in got.addressable_shards} == {(4, 1)}
