"""rl/train/update.py cases that mutation testing found unchecked (each test names the mistake), on
toy models: the auxiliary loss terms of a micro-batch, the router-bias update of a skipped step,
and the learning rate an update logs."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rl.train import objectives as obj_lib
from rl.train import update as update_lib
from tests.test_train_step_mutants import _tc, _Toy
from training import train_step as ts


class _AuxToy(nnx.Module):
  """logits = w[inputs]; constant auxiliary losses z 3, seq_aux 5, indexer 7; a non-Param counter
  that the stand-in router-bias update moves."""

  def __init__(self):
    self.w = nnx.Param(jnp.asarray(np.random.default_rng(0).standard_normal((5, 5)), jnp.float32))
    self.count = nnx.Variable(jnp.zeros((), jnp.float32))

  def __call__(self, inputs, positions, segment_ids, routing=None, routing_mask=None):
    return self.w[...][inputs], {"z_loss": jnp.asarray(3.0), "seq_aux_loss": jnp.asarray(5.0),
                                 "indexer_loss": jnp.asarray(7.0)}


def _batch():
  inputs = jnp.asarray([[1, 2, 3], [4, 0, 1]], jnp.int32)
  mask = jnp.asarray([[1, 1, 0], [1, 1, 1]], jnp.float32)
  return {"inputs": inputs, "targets": (inputs + 1) % 5, "positions": jnp.zeros_like(inputs),
          "segment_ids": jnp.ones_like(inputs), "mask": mask, "advantages": jnp.asarray([1.0, -0.5]),
          "logp_old": jnp.full((2, 3), -1.5), "logp_rollout": jnp.full((2, 3), -1.5)}


def test_micro_batch_loss_adds_each_weighted_aux_term_split_over_micro_batches():
  """loss = policy_loss + (z_loss_weight * z + seq_aux_weight * seq_aux + indexer_loss_weight *
  indexer) / n_micro: 0.1 * 3 + 0.01 * 5 + 0.2 * 7 = 1.75, over 2 micro-batches 0.875."""
  obj = obj_lib.Objective()
  tc = _tc(z_loss_weight=0.1, seq_aux_weight=0.01, indexer_loss_weight=0.2)
  model = _AuxToy()
  opt = nnx.Optimizer(model, ts.make_optimizer(tc), wrt=nnx.Param)
  _, m = update_lib.micro_grads(model, opt, _batch(), obj, tc, 2)
  assert abs(float(m["policy_loss"])) > 0.1  # a real policy term next to the auxiliary ones
  np.testing.assert_allclose(float(m["loss"]) - float(m["policy_loss"]), 0.875, rtol=1e-5)
  _, m1 = update_lib.micro_grads(model, opt, _batch(), obj, tc, 1)
  np.testing.assert_allclose(float(m1["loss"]) - float(m1["policy_loss"]), 1.75, rtol=1e-5)


def test_a_skipped_update_leaves_the_router_biases(monkeypatch):
  """The router-bias update runs at rate router_bias_rate after an applied update and at rate 0
  after a skipped one (the stand-in update adds the rate it gets to a counter)."""
  def fake_update(moe, loads, rate):
    for layer in moe:
      layer.count.set_value(layer.count[...] + rate)

  monkeypatch.setattr(update_lib, "find_moe_modules", lambda model: {("m",): model})
  monkeypatch.setattr(update_lib, "update_router_biases", fake_update)
  tc = _tc(router_bias_rate=0.25)
  model = _AuxToy()
  opt = nnx.Optimizer(model, ts.make_optimizer(tc), wrt=nnx.Param)
  load = jnp.ones((1, 5))
  for finite, want in ((False, 0.0), (True, 0.25), (False, 0.25)):
    grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    update_lib.apply_grads(model, opt, grads, load, tc, np.bool_(finite))
    assert float(model.count[...]) == want, finite


def test_logged_learning_rate_is_the_rate_applied_after_skipped_updates():
  """After two skipped (non-finite) updates the schedule has counted no update (apply_if_finite), but
  the logged learning_rate was read at optimizer.step (2): 0.075 was logged while 0.025 moved the
  weights. Warm-up over 4 updates to 0.1: update n (applied ones counted) uses 0.1 * (n + 1) / 4."""
  tc = _tc(global_batch=4, learning_rate=0.1, warmup_steps=4, steps=10, end_lr_fraction=1.0)
  model = _Toy()
  opt = nnx.Optimizer(model, ts.make_optimizer(tc), wrt=nnx.Param)
  got = []
  for finite in (False, False, True, True):
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), nnx.state(model, nnx.Param))
    before = np.asarray(model.bias[...]).copy()
    m = update_lib.apply_grads(model, opt, grads, None, tc, np.bool_(finite))
    got.append(float(m["learning_rate"]))
    if finite:  # Adam's first steps on a constant gradient move each bias by the rate itself
      np.testing.assert_allclose(before - np.asarray(model.bias[...]), got[-1], rtol=1e-4)
  np.testing.assert_allclose(got, [0.025, 0.025, 0.025, 0.05], rtol=1e-6)
