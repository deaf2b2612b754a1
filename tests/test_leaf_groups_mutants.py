"""Mutation audit of training/leaf_groups.py: which leaves stack together (digit-string layer keys, the
max_elements boundary) and the skip rule's counters, against groupings and counts written out here."""

import jax.numpy as jnp
import optax

from training import leaf_groups as lg


def test_digit_string_keys_are_layer_indices():
  """A state dict keyed '0', '1' (layer numbers as strings) groups its layers like integer keys."""
  tree = {"blocks": {"0": {"w": jnp.ones((2, 3))}, "1": {"w": jnp.zeros((2, 3))}}, "v2": jnp.ones(3)}
  groups = lg.LeafGroups.of(tree)
  assert groups.keys == ("blocks/*/w:float32[2, 3]", "v2:float32[3]")
  assert groups.members == ((0, 1), (2,))


def test_a_leaf_of_exactly_max_elements_is_grouped():
  tree = {"a": [jnp.ones((5, 3)), jnp.ones((5, 3))], "b": [jnp.ones(16), jnp.ones(16)]}
  groups = lg.LeafGroups.of(tree, max_elements=15)  # 15 elements: stacked; 16: one group each
  assert groups.keys == ("a/*:float32[5, 3]", "['b'][0]:float32[16]", "['b'][1]:float32[16]")
  assert groups.members == ((0, 1), (2,), (3,))


def test_grouped_apply_keeps_bf16_params_under_f32_updates():
  """SGD at rate 0.5 on bf16 parameters with f32 gradients 0.25: 1 - 0.125 = 0.875 (exact in bf16), and
  the parameters stay bf16 (p + u alone would be f32, unlike the skip branch's p)."""
  params = {"a": [jnp.ones(3, jnp.bfloat16), jnp.ones(3, jnp.bfloat16)]}
  grads = {"a": [jnp.full(3, 0.25, jnp.float32), jnp.full(3, 0.25, jnp.float32)]}
  tx = lg.grouped_apply_if_finite(optax.sgd(0.5), None, 3)
  new, state = lg.grouped_apply(tx, grads, tx.init(params), params)
  for leaf in new["a"]:
    assert leaf.dtype == jnp.bfloat16
    assert leaf.tolist() == [0.875, 0.875, 0.875]
  assert int(state.notfinite_count) == 0 and bool(state.last_finite)
