"""The RL update on a device mesh (FSDP x expert parallel, as pretraining shards) equals the
same update on one device: same episodes, same loss, gradient norm and new weights."""

import jax
import numpy as np
import pytest
from flax import nnx

from configs import rl as rl_configs
from sharding import mesh as mesh_lib

pytestmark = pytest.mark.slow  # two tiny_sharded trainers and engines: ~1 minute on 2 cores


def _run(tmp_path, name, mesh_sizes, devices):
  from rl.train.trainer import RLRun
  config = rl_configs.get_config("grpo,tiny_sharded")
  config.mesh.update(mesh_sizes)
  config.metrics.tensorboard = False
  # Adam's first step moves a weight by lr * g / (|g| + eps): with eps 1e-8, a gradient element near
  # zero (a sum that cancels) moves by a fraction of lr set by its rounding, which the two meshes'
  # reduction orders differ in (one element of 5,152 moved 5% of lr apart). With eps above f32's
  # rounding of such sums the step is linear in g there, and the comparison tests the sharding.
  config.train.eps = 1e-3
  return RLRun(config, str(tmp_path / name), devices=devices)


def _leaves(model):
  return {jax.tree_util.keystr(p): np.asarray(v) for p, v in
          jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))}


def test_sharded_update_equals_single_device(tmp_path):
  assert jax.device_count() == 8, "tests/conftest.py gives the suite 8 CPU devices"
  sharded = _run(tmp_path, "mesh", dict(data=1, fsdp=2, expert=4, tensor=1), None)
  single = _run(tmp_path, "one", dict(data=1, fsdp=1, expert=1, tensor=1), jax.devices()[:1])
  assert dict(sharded.mesh.shape)["expert"] == 4 and single.mesh.size == 1
  try:
    with mesh_lib.activate(sharded.mesh):
      sharded.build()
      episodes, _, _ = sharded.rollout(0)
      # the MoE experts really are split over the expert axis, the rows over the batch axes
      specs = {str(v.sharding.spec) for v in jax.tree.leaves(nnx.state(sharded.model, nnx.Param))}
      assert any("expert" in s for s in specs), specs
      rows = sharded._micro({"x": np.ones((8, 5), np.float32)}, slice(0, 8))["x"]
      assert len(rows.sharding.device_set) == 8 and rows.sharding.spec[1] is None
      before = _leaves(sharded.model)
      m_sharded = sharded.update(episodes)
      after_sharded = _leaves(sharded.model)
    with mesh_lib.activate(single.mesh):
      single.build()
      m_single = single.update(episodes)
      after_single = _leaves(single.model)
  finally:
    sharded.close()
    single.close()
  assert len(episodes) == 8 and m_sharded["finite"] == 1.0
  for key in ("loss", "policy_loss", "grad_norm", "entropy", "abs_dlogp"):
    np.testing.assert_allclose(m_sharded[key], m_single[key], rtol=1e-4, atol=1e-6, err_msg=key)
  moved = 0
  for k, v in after_single.items():
    np.testing.assert_allclose(after_sharded[k], v, rtol=1e-4, atol=1e-6, err_msg=k)
    moved += not np.array_equal(before[k], v)
  assert moved > len(after_single) // 2, "the update changed too few parameters to compare"
