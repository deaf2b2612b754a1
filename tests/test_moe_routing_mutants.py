"""model.moe_routing on hand-made cases that mutation testing found unchecked (references written out)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from model import moe_routing


def _close(got, want, rtol=1e-6):
  np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rtol, atol=0)


def test_router_scores_by_hand():
  ln3 = math.log(3.0)
  logits = jnp.asarray([[0.0, ln3, -ln3], [1.0, 1.0, 1.0 + math.log(2.0)]], jnp.bfloat16)
  sig = moe_routing.router_scores(logits, "sigmoid")
  assert sig.dtype == jnp.float32  # scores are f32 whatever the logits' dtype
  _close(sig[0], [0.5, 0.75, 0.25], rtol=1e-2)  # bf16 logits: ln 3 rounded to 8 bits
  soft = moe_routing.router_scores(jnp.asarray([[1.0, 2.0, 3.0], [0.0, 0.0, math.log(2.0)]]), "softmax")
  assert soft.dtype == jnp.float32
  total = math.e + math.e ** 2 + math.e ** 3  # softmax over the experts of each token
  _close(soft, [[math.e / total, math.e ** 2 / total, math.e ** 3 / total], [0.25, 0.25, 0.5]])
  with pytest.raises(ValueError, match="kind='relu'"):
    moe_routing.router_scores(logits, "relu")


# 9 experts in 3 groups of 3. Group score = sum of the group's two best: g0 0.95, g1 1.0, g2 0.96
# (the max alone would rank g0 first, the sum of all three g1 then g0).
_SCORES = [0.9, 0.05, 0.05, 0.5, 0.5, 0.5, 0.6, 0.36, 0.0]


def _select(scores, bias, k, groups=1, topk_groups=1):
  out = moe_routing.select_experts(jnp.asarray(scores, jnp.float32), jnp.asarray(bias, jnp.float32), k,
                                   groups, topk_groups)
  assert out.dtype == jnp.int32
  return np.asarray(out).tolist()


def test_group_limited_selection_by_hand():
  # Best 2 groups: g1 and g2, so experts 3..8 only: 0.6 (id 6), then 0.5 (id 3, lowest id of a tie).
  assert _select(_SCORES, np.zeros(9), 2, groups=3, topk_groups=2) == [6, 3]
  # Best group g1 alone: its three 0.5s, lowest ids first.
  assert _select(_SCORES, np.zeros(9), 2, groups=3, topk_groups=1) == [3, 4]
  # A bias that makes every biased score negative must not let masked-out groups back in.
  assert _select(_SCORES, np.full(9, -5.0), 2, groups=3, topk_groups=2) == [6, 3]
  # Without groups the plain top-2.
  assert _select(_SCORES, np.zeros(9), 2) == [0, 6]
  # Leading batch dims are kept.
  both = _select([_SCORES, _SCORES[::-1]], np.zeros(9), 1, groups=3, topk_groups=1)
  assert both == [[3], [3]]  # reversed: g1 is still the middle group, its first 0.5 is id 3


def test_two_groups_and_one_expert_per_group():
  # 2 groups of 2: g0 0.9 + 0.1 = 1.0 < g1 0.6 + 0.5 = 1.1, so only experts 2, 3 are eligible.
  assert _select([0.9, 0.1, 0.6, 0.5], np.zeros(4), 2, groups=2, topk_groups=1) == [2, 3]
  # Groups of one expert: a group's score is its expert's score.
  assert _select([0.1, 0.7, 0.4, 0.2], np.zeros(4), 2, groups=4, topk_groups=2) == [1, 2]


def test_bias_is_added_for_selection():
  assert _select([0.5, 0.4, 0.3], [0.0, 0.0, 0.3], 1) == [2]  # 0.3 + 0.3 > 0.5
  assert _select([0.5, 0.4, 0.3], [-0.2, 0.0, 0.0], 1) == [1]


@pytest.mark.parametrize("k,groups,topk_groups,fragment", [
    (2, 3, 1, "groups=3 must divide num_experts=8"), (2, 0, 1, "groups=0"),
    (2, 2, 3, r"topk_groups=3 must be in \[1, groups=2\]"), (2, 2, 0, "topk_groups=0"),
    (5, 2, 1, r"k=5 must be in \[1, 4\]"), (0, 1, 1, "k=0"), (9, 1, 1, "k=9"),
])
def test_select_experts_refuses_bad_args(k, groups, topk_groups, fragment):
  with pytest.raises(ValueError, match=fragment):
    moe_routing.select_experts(jnp.full((2, 8), 0.5), jnp.zeros(8), k, groups, topk_groups)


def test_combine_weights_by_hand():
  scores = jnp.asarray([[0.5, 0.75, 0.25, 0.5], [0.3, 0.1, 0.7, 0.2]], jnp.float32)
  idx = jnp.asarray([[1, 3], [2, 0]], jnp.int32)
  # Normalised over the k picks: 0.75 / 1.25, 0.5 / 1.25; 0.7 / 1.0, 0.3 / 1.0; then x 2.5.
  _close(moe_routing.combine_weights(scores, idx, True, 2.5), [[1.5, 1.0], [1.75, 0.75]])
  # Not normalised: the picked scores themselves (exactly, in f32), times the scale.
  got = moe_routing.combine_weights(scores, idx, False, 1.0)
  np.testing.assert_array_equal(np.asarray(got), np.asarray([[0.75, 0.5], [0.7, 0.3]], np.float32))
  _close(moe_routing.combine_weights(scores, idx, False, 2.0), [[1.5, 1.0], [1.4, 0.6]])


def test_sequence_aux_loss_by_hand():
  """e = 3 experts, k = 1, t = 2; f_i = e / (k n) * count_i, P_i = mean of scores / their sum."""
  scores = jnp.asarray([
      [[0.1, 0.1, 0.3], [1.0, 0.5, 0.5]],  # normalised: [0.2, 0.2, 0.6], [0.5, 0.25, 0.25]
      [[0.3, 0.3, 0.4], [9.0, 1.0, 9.0]],  # second token is padding
      [[0.2, 0.2, 0.2], [0.1, 0.5, 0.9]],  # all padding
  ], jnp.float32)
  idx = jnp.asarray([[[2], [0]], [[1], [1]], [[0], [0]]], jnp.int32)
  valid = jnp.asarray([[True, True], [True, False], [False, False]])
  # Row 0: f = 3/2 * [1, 0, 1], P = [0.35, 0.225, 0.425]: 1.5 * 0.35 + 1.5 * 0.425 = 1.1625.
  # Row 1: n = 1, f = [0, 3, 0], P = [0.3, 0.3, 0.4]: 0.9. Row 2 adds 0; the mean is over 3 rows.
  _close(moe_routing.sequence_aux_loss(scores, idx, valid), (1.1625 + 0.9) / 3)
  _close(moe_routing.sequence_aux_loss(scores[:1], idx[:1]), 1.1625)


def test_sequence_aux_loss_with_two_slots():
  """k = 2: each token counts twice, f_i = e / (k t) * count_i. Scores sum to 1 per token."""
  scores = jnp.asarray([[[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]]], jnp.float32)
  idx = jnp.asarray([[[0, 1], [0, 2]]], jnp.int32)
  # counts [2, 1, 1, 0], f = 4 / 4 * counts; P = [0.375, 0.275, 0.225, 0.125].
  _close(moe_routing.sequence_aux_loss(scores, idx), 2 * 0.375 + 0.275 + 0.225)


def test_router_z_loss_by_hand():
  logits = jnp.asarray([[0.0, 0.0], [math.log(3.0), 0.0]], jnp.float32)  # logsumexp: ln 2, ln 4
  _close(moe_routing.router_z_loss(logits), (math.log(2.0) ** 2 + math.log(4.0) ** 2) / 2)
  # Padding adds 0 but the mean stays over both positions.
  _close(moe_routing.router_z_loss(logits, jnp.asarray([True, False])), math.log(2.0) ** 2 / 2)
