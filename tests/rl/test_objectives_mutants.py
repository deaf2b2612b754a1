"""rl/train/objectives.py cases that mutation testing found unchecked; every expected value is worked
out by hand in the comments (each test names the mistake it catches)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.train import objectives as obj_lib


def _on_policy(mask, adv, logp_rollout_shift=None):
  """A batch at ratio 1 (logp = logp_old): each sampled token's loss is -A x its TIS weight."""
  mask = np.asarray(mask, np.float32)
  logp = np.full(mask.shape, -1.0, np.float32)
  roll = logp if logp_rollout_shift is None else logp - np.asarray(logp_rollout_shift, np.float32)
  batch = {"mask": jnp.asarray(mask), "logp_old": jnp.asarray(logp), "logp_rollout": jnp.asarray(roll),
           "advantages": jnp.asarray(adv, jnp.float32)}
  return jnp.asarray(logp), batch


# Row 1 is an episode that failed before generating (to_batch leaves its mask all 0).
EMPTY_ROW_MASK = [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]]
EMPTY_ROW_ADV = [1.0, 0.5, -2.0]
# Token losses -A: row 0: -1, -1; row 2: 2, 2, 2. Sum 4 over 5 tokens.
EMPTY_ROW_LOSS = {
  "dapo": 4 / 5,  # token_mean
  "grpo": (-1 + 0 + 2) / 3,  # seq_mean: row means -1, 0 (empty), 2 over the 3 rows
  "gspo": (-1 + 0 + 2) / 3,  # seq_mean with the sequence ratio exp(mean log ratio) = 1
  "dr_grpo": 4 / (3 * 4),  # constant: samples x T
  "rloo": 4 / 5,  # token_mean
}


@pytest.mark.parametrize("algorithm", obj_lib.ALGORITHMS)
def test_an_empty_row_adds_nothing_and_no_nan(algorithm):
  """A row with no sampled token (seq_mean's per-row divisor, GSPO's mean log ratio over 0 tokens)
  must count as 0 and not turn the loss or the gradient into NaN."""
  logp, batch = _on_policy(EMPTY_ROW_MASK, EMPTY_ROW_ADV)
  o = obj_lib.objective(algorithm)
  loss, grad = jax.value_and_grad(lambda x: obj_lib.policy_loss(x, batch, o)[0])(logp)
  np.testing.assert_allclose(float(loss), EMPTY_ROW_LOSS[algorithm], rtol=1e-6)
  assert np.all(np.isfinite(np.asarray(grad))) and np.all(np.asarray(grad)[1] == 0)


@pytest.mark.parametrize("algorithm", obj_lib.ALGORITHMS)
def test_a_batch_without_sampled_tokens_has_zero_loss_and_weights(algorithm):
  """Every episode failed: the loss, the metrics and the whole-batch token weights are 0, not NaN."""
  mask = np.zeros((2, 3), np.float32)
  logp, batch = _on_policy(mask, [1.0, -1.0])
  o = obj_lib.objective(algorithm)
  loss, metrics = obj_lib.policy_loss(logp, batch, o)
  assert float(loss) == 0.0 and all(float(v) == 0.0 for v in metrics.values())
  w = obj_lib.token_weights(mask, o)
  assert w.shape == (2, 3) and np.all(w == 0)


def test_constant_aggregation_divides_by_norm_tokens():
  """Dr. GRPO: sum of token losses / (samples x norm_tokens), not the batch's T: 4 / (3 x 10)."""
  logp, batch = _on_policy(EMPTY_ROW_MASK, EMPTY_ROW_ADV)
  o = obj_lib.objective("dr_grpo", norm_tokens=10)
  np.testing.assert_allclose(float(obj_lib.policy_loss(logp, batch, o)[0]), 4 / 30, rtol=1e-6)
  np.testing.assert_allclose(obj_lib.token_weights(np.asarray(EMPTY_ROW_MASK), o)[0], [0.1 / 3] * 2 + [0, 0],
                             rtol=1e-6)


@pytest.mark.parametrize("tis_cap, loss, clip_frac", [
  (0.0, (-1 - 1 - 0.5 - 0.5) / 4, 0.0),  # 0 = no TIS weighting: plain -A per token
  (2.0, (-2 - 1 - 0.5 - 0.5) / 4, 0.0),  # token (0, 0) weighted by exp(log 2) = 2, under the cap
  (1.5, (-1.5 - 1 - 0.5 - 0.5) / 4, 0.25),  # ... capped at 1.5: one token of four hits the cap
])
def test_tis_weights_and_cap(tis_cap, loss, clip_frac):
  """The engine sampled token (0, 0) at half the trainer's probability: TIS weight 2. tis_cap=0
  turns the weighting off (it must not weight every token by min(w, 0) = 0)."""
  logp, batch = _on_policy(np.ones((2, 2)), [1.0, 0.5], [[math.log(2.0), 0.0], [0.0, 0.0]])
  o = obj_lib.objective("dapo", tis_cap=tis_cap)
  got, metrics = obj_lib.policy_loss(logp, batch, o)
  np.testing.assert_allclose(float(got), loss, rtol=1e-6)
  np.testing.assert_allclose(float(metrics["tis_clip_frac"]), clip_frac, rtol=1e-6)


def test_kl_in_the_loss_is_not_also_taken_from_the_reward():
  """The trainer subtracts kl_reward_penalty from every reward whenever a reference model exists;
  with kl_place='in_loss' it must be 0, or the KL counts twice."""
  lp, ref, mask = np.full((2, 3), -1.0), np.full((2, 3), -2.0), np.ones((2, 3))
  for o in (obj_lib.objective("grpo", kl="k3", kl_coef=0.5), obj_lib.objective("grpo")):
    np.testing.assert_array_equal(obj_lib.kl_reward_penalty(lp, ref, mask, o), [0.0, 0.0])
  o = obj_lib.objective("grpo", kl="k1", kl_coef=0.5, kl_place="in_reward")
  np.testing.assert_allclose(obj_lib.kl_reward_penalty(lp, ref, mask, o), [1.5, 1.5])  # 0.5 x 3 x (-1 + 2)


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "rloo"])
def test_a_group_of_one_has_advantage_zero(algorithm):
  """A group left with one sample (its partners dropped) has no baseline: advantage 0, not NaN
  (RLOO's leave-one-out mean over 0 others). Group 9: rewards 1, 0, 0.5 (mean 0.5, std sqrt(1/6))."""
  adv = obj_lib.advantages([0.7, 1.0, 0.0, 0.5], [4, 9, 9, 9], obj_lib.objective(algorithm))
  want = {"grpo": [0.0, 0.5 / math.sqrt(1 / 6), -0.5 / math.sqrt(1 / 6), 0.0],
          "dr_grpo": [0.0, 0.5, -0.5, 0.0],
          "rloo": [0.0, 1.0 - 0.25, 0.0 - 0.75, 0.5 - 0.5]}[algorithm]
  np.testing.assert_allclose(adv, want, rtol=1e-5)


def test_integer_rewards_give_fractional_advantages():
  """Rewards given as ints (0/1 graders) must not truncate the advantages to ints: r - 1/3."""
  o = obj_lib.objective("dr_grpo")
  np.testing.assert_allclose(obj_lib.advantages(np.array([1, 0, 0]), [0, 0, 0], o), [2 / 3, -1 / 3, -1 / 3])
  adv = obj_lib.advantages([1, 0, 0], np.array([2, 2, 2], np.int64), obj_lib.objective("grpo"))
  np.testing.assert_allclose(adv, [(2 / 3) / (math.sqrt(2) / 3), -(1 / 3) / (math.sqrt(2) / 3),
                                   -(1 / 3) / (math.sqrt(2) / 3)], rtol=1e-5)


def test_presets_are_the_papers_settings():
  """Each preset's every knob, as its paper sets it (module docstring)."""
  want = {
    "grpo": dict(advantage="group_norm", ratio="token", eps_low=0.2, eps_high=0.2, aggregation="seq_mean",
                 dynamic_sampling=False, overlong_buffer=0),
    "dr_grpo": dict(advantage="group_mean", ratio="token", eps_low=0.2, eps_high=0.2, aggregation="constant",
                    dynamic_sampling=False, overlong_buffer=0),
    "dapo": dict(advantage="group_norm", ratio="token", eps_low=0.2, eps_high=0.28, aggregation="token_mean",
                 dynamic_sampling=True, overlong_buffer=64),
    "gspo": dict(advantage="group_norm", ratio="sequence", eps_low=3e-4, eps_high=4e-4,
                 aggregation="seq_mean", dynamic_sampling=False, overlong_buffer=0),
    "rloo": dict(advantage="loo", ratio="token", eps_low=0.2, eps_high=0.2, aggregation="token_mean",
                 dynamic_sampling=False, overlong_buffer=0),
  }
  for algorithm, knobs in want.items():
    o = obj_lib.objective(algorithm)
    assert {k: getattr(o, k) for k in knobs} == knobs, algorithm
    assert (o.kl, o.kl_coef, o.tis_cap) == ("none", 0.0, 2.0), algorithm


def test_none_overrides_keep_the_preset():
  o = obj_lib.objective("dapo", eps_high=None, aggregation=None, overlong_buffer=None, kl=None)
  assert (o.eps_high, o.aggregation, o.overlong_buffer, o.kl) == (0.28, "token_mean", 64, "none")


@pytest.mark.parametrize("knobs, message", [
  (dict(eps_low=1.0), r"config\.rl\.eps_low=1\.0: must be < 1"),  # lower clip 0: a ratio of 0 unclipped
  (dict(adv_eps=0.0), r"Objective\.adv_eps=0\.0: must be finite and > 0"),  # a tied group: 0 / 0
  (dict(norm_tokens=-5, aggregation="constant"), r"norm_tokens must be >= 0"),  # a negative divisor
  (dict(overlong_buffer=-1), r"overlong_buffer and config\.rl\.norm_tokens must be >= 0"),
  (dict(tis_cap=math.nan), r"config\.rl\.tis_cap=nan: must be >= 0 \(inf: no cap\)"),  # a NaN loss
  (dict(eps_high=math.nan), r"config\.rl\.eps_high=nan: must be >= 0 \(inf: no cap\)"),
])
def test_boundary_knobs_are_refused(knobs, message):
  with pytest.raises(ValueError, match=message):
    obj_lib.Objective(**knobs)
