"""Mutation audit of training/train_step.py on a toy model whose gradients are written out in NumPy:
token-weighted accumulation over micro-batches with different masks, the auxiliary terms' share per
micro-batch, the reported metrics (ce, tokens, grad_norm) and the blame order of non-finite steps."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import horizon
from training import leaf_groups
from training import train_step as ts

VOCAB, DIM = 7, 3


def _tc(**changes) -> ts.TrainConfig:
  base = dict(horizon.get_config("tiny").train.items(), group_max_elements=0, z_loss_weight=0.0,
              seq_aux_weight=0.0, indexer_loss_weight=0.0)
  return ts.TrainConfig.from_config({**base, **changes})


class _Toy(nnx.Module):
  """logits = embed[inputs] @ embed.T + bias; z_loss = mean over all the micro-batch's tokens of
  logsumexp(logits)^2, seq_aux_loss = mean(inputs), indexer_loss = mean(segment_ids) (no gradients)."""

  def __init__(self):
    rng = np.random.default_rng(5)
    self.embed = nnx.Param(jnp.asarray(rng.standard_normal((VOCAB, DIM)) * 0.7, jnp.float32))
    self.bias = nnx.Param(jnp.asarray(rng.standard_normal(VOCAB) * 0.3, jnp.float32))

  def __call__(self, inputs, positions, segment_ids, images=None):
    e = self.embed[...]
    logits = e[inputs] @ e.T + self.bias[...]
    z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return logits, {"z_loss": z, "seq_aux_loss": jnp.mean(inputs.astype(jnp.float32)),
                    "indexer_loss": jnp.mean(segment_ids.astype(jnp.float32))}


def _batch():
  """4 rows of 6 tokens; rows 1 and 3 (micro-batch 1 of 2) are mostly padding."""
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, VOCAB, (4, 7))
  seg = np.array([[1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [1, 1, 1, 2, 2, 2], [1, 1, 0, 0, 0, 0]])
  return {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
          "positions": jnp.asarray(np.tile(np.arange(6), (4, 1)), jnp.int32),
          "segment_ids": jnp.asarray(seg, jnp.int32)}


def _np_logits(model, inputs):
  e = np.asarray(model.embed[...], np.float64)
  return e[np.asarray(inputs)] @ e.T + np.asarray(model.bias[...], np.float64)


def _np_softmax(logits):
  z = np.exp(logits - logits.max(-1, keepdims=True))
  return z / z.sum(-1, keepdims=True)


@nnx.jit(static_argnames=("tc",))
def _grads(model, batch, tc):
  return ts._grads(model, batch, tc, nnx.Param)


def _reference(model, batch, mask, rows_per_micro):
  """(ce_sum, tokens, z_loss, seq_aux, indexer_loss, bias gradient) of the whole batch as written out:
  CE summed over the masked tokens / all masked tokens; z_loss and seq_aux means over micro-batches
  of each micro-batch's mean; d loss / d bias = sum over masked tokens (softmax - onehot) / tokens."""
  logits = _np_logits(model, batch["inputs"])
  targets = np.asarray(batch["targets"])
  logz = np.log(np.exp(logits).sum(-1))
  gold = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  ce_sum = float(((logz - gold) * mask).sum())
  tokens = float(mask.sum())
  z = np.mean([np.mean(logz[r] ** 2) for r in rows_per_micro])
  aux = np.mean([np.mean(np.asarray(batch["inputs"])[r]) for r in rows_per_micro])
  idx = np.mean([np.mean(np.asarray(batch["segment_ids"])[r]) for r in rows_per_micro])
  onehot = np.eye(VOCAB)[targets]
  g_bias = ((_np_softmax(logits) - onehot) * mask[..., None]).sum((0, 1)) / tokens
  return ce_sum, tokens, z, aux, idx, g_bias


@pytest.mark.parametrize("k,rows", [(1, [[0, 1, 2, 3]]), (2, [[0, 2], [1, 3]]), (4, [[0], [1], [2], [3]])])
def test_accumulated_gradient_is_the_token_weighted_whole_batch(k, rows):
  """Micro-batch i takes rows i, i+k, ...; every micro-batch's CE is divided by the whole batch's
  15 tokens (not a mean of per-micro-batch means: those would weigh row 1's one token like row 0's
  six) and the auxiliary terms are averaged over the micro-batches."""
  tc = _tc(grad_accum=k, global_batch=4, z_loss_weight=0.25, seq_aux_weight=0.5, indexer_loss_weight=2.0)
  model, batch = _Toy(), _batch()
  mask = (np.asarray(batch["segment_ids"]) > 0).astype(np.float64)
  grads, m = _grads(model, batch, tc)
  ce_sum, tokens, z, aux, idx, g_bias_ce = _reference(model, batch, mask, rows)
  assert tokens == 15.0 and float(m["tokens"]) == 15.0
  np.testing.assert_allclose(float(m["ce_sum"]), ce_sum, rtol=1e-5)
  np.testing.assert_allclose(float(m["z_loss"]), z, rtol=1e-5)
  np.testing.assert_allclose(float(m["seq_aux_loss"]), aux, rtol=1e-6)
  np.testing.assert_allclose(float(m["indexer_loss"]), idx, rtol=1e-6)
  np.testing.assert_allclose(float(m["loss"]), ce_sum / 15.0 + 0.25 * z + 0.5 * aux + 2.0 * idx, rtol=1e-5)
  # The z-loss's own bias gradient: d/db mean_i mean_t logz^2 = mean_i mean_t 2 logz softmax.
  logits = _np_logits(model, batch["inputs"])
  logz = np.log(np.exp(logits).sum(-1))
  dz = np.mean([np.mean(2 * logz[r][..., None] * _np_softmax(logits[r]), axis=(0, 1)) for r in rows], axis=0)
  np.testing.assert_allclose(np.asarray(grads["bias"][...]), g_bias_ce + 0.25 * dz, rtol=1e-5, atol=1e-7)


def test_loss_mask_overrides_segment_ids_in_both_numerator_and_denominator():
  """An SFT-style loss_mask (prompt tokens masked out) weighs the CE and sets the token count, with
  grad accumulation too: 3 + 1 masked tokens, not the 15 real ones."""
  model, batch = _Toy(), _batch()
  mask = np.zeros((4, 6))
  mask[0, 3:] = 1.0  # three answer tokens in row 0
  mask[3, 1] = 1.0  # one in row 3 (micro-batch 1 when k = 2)
  batch["loss_mask"] = jnp.asarray(mask, jnp.float32)
  for k in (1, 2):
    grads, m = _grads(model, batch, _tc(grad_accum=k, global_batch=4))
    ce_sum, tokens, _, _, _, g_bias = _reference(model, batch, mask, [[0, 1, 2, 3]])
    assert float(m["tokens"]) == 4.0
    np.testing.assert_allclose(float(m["loss"]), ce_sum / 4.0, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grads["bias"][...]), g_bias, rtol=1e-5, atol=1e-7)


def test_an_all_padding_batch_is_a_finite_zero_step():
  """No real token: CE 0 over a token count floored at 1 (not 0 / 0), zero gradients, finite."""
  tc = _tc(global_batch=4, grad_accum=2)
  model, batch = _Toy(), _batch()
  batch["segment_ids"] = jnp.zeros((4, 6), jnp.int32)
  opt = nnx.Optimizer(model, ts.make_optimizer(tc), wrt=nnx.Param)
  m = jax.device_get(ts.jit_train_step(model, opt, batch, tc))
  assert bool(m["finite"]) and float(m["tokens"]) == 0.0
  assert float(m["ce"]) == 0.0 and float(m["grad_norm"]) == 0.0


def test_split_micro_takes_every_kth_row():
  x = jnp.arange(12).reshape(6, 2)
  got = ts._split_micro({"x": x}, 3)["x"]
  np.testing.assert_array_equal(got, [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]])
  with pytest.raises(ValueError, match="batch of 6 rows is not divisible by config.train.grad_accum=4"):
    ts._split_micro({"x": x}, 4)


def test_loss_fn_refuses_a_batch_without_its_keys():
  batch = _batch()
  del batch["positions"]
  with pytest.raises(ValueError, match=r"batch is missing \['positions'\]"):
    ts.loss_fn(_Toy(), batch, _tc())


def test_train_step_reports_ce_tokens_and_unclipped_grad_norm():
  """ce = CE sum / tokens; grad_norm is the global L2 norm of the raw gradient (before the clip to
  1e-3 the update uses); learning_rate is update 0's (lr / warmup)."""
  tc = _tc(global_batch=4, grad_clip=1e-3, learning_rate=0.02, warmup_steps=4)
  model, batch = _Toy(), _batch()
  mask = (np.asarray(batch["segment_ids"]) > 0).astype(np.float64)
  grads, _ = _grads(model, batch, tc)
  want_norm = np.sqrt(sum(float(np.sum(np.asarray(g, np.float64) ** 2)) for g in jax.tree.leaves(grads)))
  ce_sum, tokens, _, _, _, _ = _reference(model, batch, mask, [[0, 1, 2, 3]])
  opt = nnx.Optimizer(model, ts.make_optimizer(tc), wrt=nnx.Param)
  m = jax.device_get(ts.jit_train_step(model, opt, batch, tc))
  assert bool(m["finite"]) and float(m["tokens"]) == 15.0
  np.testing.assert_allclose(float(m["ce"]), ce_sum / tokens, rtol=1e-5)
  np.testing.assert_allclose(float(m["grad_norm"]), want_norm, rtol=1e-5)
  assert want_norm > 100 * tc.grad_clip
  np.testing.assert_allclose(float(m["learning_rate"]), 0.02 / 4, rtol=1e-6)
  assert list(m["grad_finite"]) == [True, True] and list(m["param_finite"]) == [True, True]


def test_nonfinite_report_blames_parameter_then_loss_then_first_gradient():
  names = ["['a']", "['b']", "['c']"]
  base = {"finite": False, "loss": 1.5, "param_finite": [True, True, True],
          "grad_finite": [True, False, False]}
  msg = ts.nonfinite_report(3, base, names)
  assert msg.startswith("step 3: gradient of ['b'] is non-finite (2 of 3 gradients non-finite); the update "
                        "was not applied."), msg
  msg = ts.nonfinite_report(3, {**base, "loss": float("inf")}, names)
  assert msg.startswith("step 3: loss is inf (2 of 3 gradients non-finite)"), msg
  msg = ts.nonfinite_report(3, {**base, "loss": float("nan"), "param_finite": [True, True, False]}, names)
  assert msg.startswith("step 3: parameter ['c'] is non-finite"), msg


def test_schedule_when_warmup_outlasts_the_run():
  """warmup 5 > steps 3: every update is still warming up (peak * (n + 1) / 5), never NaN."""
  lr = ts.learning_rate_schedule(_tc(learning_rate=1.0, warmup_steps=5, steps=3, end_lr_fraction=0.1))
  np.testing.assert_allclose([float(lr(n)) for n in range(3)], [0.2, 0.4, 0.6], rtol=1e-6)


def test_decay_mask_is_matrices_only():
  tree = {"w": jnp.zeros((2, 3)), "e": jnp.zeros((2, 3, 4)), "b": jnp.zeros((3,)), "s": jnp.zeros(())}
  assert ts.decay_mask(tree) == {"w": True, "e": True, "b": False, "s": False}


def test_train_config_refuses_bad_ints():
  for field, value in (("steps", 0), ("global_batch", 2.0), ("seq_len", -1), ("grad_accum", 0)):
    with pytest.raises(ValueError, match=rf"config.train.{field}={value!r}: must be a positive int"):
      _tc(**{field: value})
  short = dataclasses.asdict(_tc())
  del short["grad_accum"]
  with pytest.raises(ValueError, match=r"unknown fields \[\], missing fields \['grad_accum'\]"):
    ts.TrainConfig.from_config(short)
  with pytest.raises(ValueError, match=r"unknown fields \['lr'\], missing fields \[\]"):
    ts.TrainConfig.from_config({**dataclasses.asdict(_tc()), "lr": 1.0})
  # inf eps made every update 0 (nothing trained, each step reported finite); inf weight decay made
  # the weights non-finite on the first update; a string failed with a bare TypeError.
  for field, value, rule in (("eps", float("inf"), "finite"), ("weight_decay", float("inf"), "finite"),
                             ("b1", "0.9", "a number"), ("grad_clip", True, "a number"),
                             ("b1", 1.0, r"in \[0, 1\)")):
    with pytest.raises(ValueError, match=rf"^config.train.{field}={value!r}: must be {rule}.$"):
      _tc(**{field: value})
  assert _tc(b1=0.0, weight_decay=0.0, end_lr_fraction=1.0, grad_clip=0.0, warmup_steps=0).b1 == 0.0
  # True counted as 1 step / 1 micro-batch; numpy ints (a sweep script's) were refused
  for field, rule in (("steps", "a positive int"), ("grad_accum", "a positive int"),
                      ("warmup_steps", "an int >= 0"), ("group_max_elements", "an int >= 0")):
    with pytest.raises(ValueError, match=rf"^config.train.{field}=True: must be {rule}"):
      _tc(**{field: True})
  tc = _tc(steps=np.int64(7), global_batch=np.int32(4), grad_accum=np.int64(2), warmup_steps=np.uint8(3))
  assert (tc.steps, tc.global_batch, tc.grad_accum, tc.warmup_steps) == (7, 4, 2, 3)
  assert {type(v) for v in (tc.steps, tc.global_batch, tc.grad_accum, tc.warmup_steps)} == {int}


class _InfAux(_Toy):
  """A toy whose sequence-balance loss is +inf: the loss is non-finite, every gradient finite."""

  def __call__(self, inputs, positions, segment_ids, images=None):
    logits, aux = super().__call__(inputs, positions, segment_ids, images)
    return logits, {**aux, "seq_aux_loss": jnp.asarray(jnp.inf, jnp.float32)}


def test_a_nonfinite_loss_with_finite_gradients_is_not_applied():
  tc = _tc(global_batch=4, seq_aux_weight=1.0)
  model, batch = _InfAux(), _batch()
  bias0 = np.asarray(model.bias[...])
  opt = nnx.Optimizer(model, ts.make_optimizer(tc), wrt=nnx.Param)
  m = jax.device_get(ts.jit_train_step(model, opt, batch, tc))
  assert list(m["grad_finite"]) == [True, True] and float(m["loss"]) == np.inf
  assert not bool(m["finite"])
  assert ts.nonfinite_report(0, m, ["['bias']", "['embed']"]).startswith("step 0: loss is inf (0 of 2 ")
  np.testing.assert_array_equal(model.bias[...], bias0)  # not applied


def test_grouped_optimizer_steps_advance_the_schedule():
  """With leaf groups (apply_update's own path) the step count moves: update 1 reports and uses
  2 / warmup of the peak rate."""
  tc = _tc(global_batch=4, learning_rate=0.02, warmup_steps=4, group_max_elements=1 << 20)
  model, batch = _Toy(), _batch()
  opt = nnx.Optimizer(model, ts.make_optimizer(tc), wrt=nnx.Param)
  rates = [float(jax.device_get(ts.jit_train_step(model, opt, batch, tc))["learning_rate"]) for _ in range(2)]
  np.testing.assert_allclose(rates, [0.02 / 4, 0.02 * 2 / 4], rtol=1e-6)
  assert int(opt.step[...]) == 2


def test_leaf_groups_stack_leaves_of_up_to_max_elements():
  """Same-role leaves of exactly max_elements elements stack into one group; one more and each is its own."""
  tree = {"blocks": [{"w": jnp.zeros((2, 2))}, {"w": jnp.ones((2, 2))}]}
  groups = leaf_groups.LeafGroups.of(tree, 4)
  assert groups.keys == ("blocks/*/w:float32[2, 2]",) and groups.members == ((0, 1),)
  assert len(leaf_groups.LeafGroups.of(tree, 3).keys) == 2


def test_finite_does_not_overflow_on_large_finite_values():
  """Two float32 values near the max are finite although their sum overflows: the check must not
  skip such a step as non-finite."""
  big = jnp.asarray([3e38, 3e38], jnp.float32)
  assert bool(leaf_groups.finite(big))
  assert not bool(leaf_groups.finite(big.at[0].set(jnp.inf)))


def test_rl_apply_grads_skips_an_update_whose_loss_is_not_finite():
  """RL's update had the same gap: finite gradients were applied after a non-finite loss, and the
  trainer then logged 'the update was skipped'. A finite loss is applied as before."""
  from rl.train import update as rl_update

  tc = _tc(global_batch=4, learning_rate=0.05, warmup_steps=0)
  model = _Toy()
  opt = nnx.Optimizer(model, ts.make_optimizer(tc), wrt=nnx.Param)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), nnx.state(model, nnx.Param))
  bias0 = np.asarray(model.bias[...])
  m = rl_update.apply_grads(model, opt, grads, None, tc, np.bool_(False))
  assert not bool(m["finite"])
  np.testing.assert_array_equal(model.bias[...], bias0)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), nnx.state(model, nnx.Param))
  m = rl_update.apply_grads(model, opt, grads, None, tc, np.bool_(True))
  assert bool(m["finite"])
  assert np.all(np.asarray(model.bias[...]) < bias0)  # a positive gradient moves every weight down
