"""training/leaf_groups: same-role leaves stacked for the optimizer give the plain optimizer's
updates, state layout and per-leaf checks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import horizon
from model.config import ModelConfig
from model.decoder import Horizon
from tests.helpers import assert_close
from training import byte_corpus
from training import leaf_groups as lg
from training import train_step as ts


def _tree(seed: int = 0):
  """Three 'layers' with a matrix and a 1-D scale, one layer of another shape, and two globals of
  the layers' matrix shape (same shape, other roles: they must not join the layers' group)."""
  rng = np.random.default_rng(seed)
  r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
  blocks = {i: {"w": r(5, 3), "scale": r(3)} for i in range(3)}
  blocks[3] = {"w": r(7, 3), "scale": r(3)}
  return {"blocks": blocks, "embed": r(5, 3), "head": {"w": r(5, 3)}}


def test_groups_by_role_dtype_and_shape_and_round_trips():
  tree = _tree()
  groups = lg.LeafGroups.of(tree)
  names = dict(zip(groups.keys, groups.members, strict=True))
  leaves = jax.tree.leaves(tree)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
  by_path = {p: i for i, p in enumerate(paths)}
  assert names["blocks/*/w:float32[5, 3]"] == tuple(by_path[f"['blocks'][{i}]['w']"] for i in range(3))
  assert names["blocks/*/w:float32[7, 3]"] == (by_path["['blocks'][3]['w']"],)
  assert names["blocks/*/scale:float32[3]"] == tuple(by_path[f"['blocks'][{i}]['scale']"] for i in range(4))
  assert names["embed:float32[5, 3]"] == (by_path["['embed']"],)
  assert names["head/w:float32[5, 3]"] == (by_path["['head']['w']"],)
  assert len(groups.keys) == 5 and groups.num_leaves == len(leaves) == 10
  stacked = groups.stack(leaves)
  assert stacked["blocks/*/w:float32[5, 3]"].shape == (3, 5, 3)
  for a, b in zip(groups.unstack(stacked), leaves, strict=True):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="9 leaves, grouped for 10"):
    groups.stack(leaves[:9])
  # Leaves above max_elements are groups of their own: the [5, 3] layers split, the scales stay.
  g12 = lg.LeafGroups.of(tree, max_elements=12)
  capped = dict(zip(g12.keys, g12.members, strict=True))
  assert capped["blocks/*/scale:float32[3]"] == names["blocks/*/scale:float32[3]"]
  assert capped["['blocks'][1]['w']:float32[5, 3]"] == (by_path["['blocks'][1]['w']"],)
  assert len(capped) == 7 and len(lg.LeafGroups.of(tree, max_elements=0).keys) == 10


def test_per_leaf_checks_come_back_in_leaf_order():
  tree = _tree()
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
  for bad in ("['blocks'][1]['w']", "['blocks'][3]['scale']", "['head']['w']"):
    broken = jax.tree_util.tree_map_with_path(
        lambda p, x, bad=bad: x.at[(0,) * x.ndim].set(jnp.inf) if jax.tree_util.keystr(p) == bad else x,
        tree)
    finite = np.asarray(lg.all_finite_per_leaf(broken))
    assert [paths[i] for i in np.flatnonzero(~finite)] == [bad]
  assert lg.all_finite_per_leaf({}).shape == (0,)



@pytest.mark.parametrize("max_elements", [None, 12, 0])
def test_finite_and_norm_is_the_global_l2_norm(max_elements):
  """The reported grad_norm: sqrt of the sum of squares over every leaf (float64 reference), not
  squared, not per group; and the per-leaf finiteness in leaf order."""
  tree = jax.tree.map(lambda x: x * 3.0, _tree(4))
  finite, norm = lg.finite_and_norm(tree, max_elements)
  want = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree)))
  assert float(norm) == pytest.approx(want, rel=1e-6)
  np.testing.assert_array_equal(finite, np.ones(len(jax.tree.leaves(tree)), bool))

def _adamw(mask):
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=mask))


@pytest.mark.parametrize("clip", [False, True])
def test_grouped_adamw_equals_plain_adamw(clip):
  """Three steps from random odd-shaped params and gradients: the same updates and the same
  per-leaf state. Without clipping the elementwise maths is the same, so bitwise; when the
  global norm clips, its sum runs in another order, so within f32 rounding of the scale."""
  params = _tree(0)
  plain = _adamw(ts.decay_mask)
  grouped = lg.grouped(_adamw(lg.grouped_mask(ts.decay_mask)))
  s_plain, s_grouped = plain.init(params), grouped.init(params)
  assert jax.tree.structure(s_grouped) == jax.tree.structure(s_plain)
  scale = 10.0 if clip else 1e-2  # global norm ~ 5 * scale: above or below the clip of 1.0
  for step in range(3):
    grads = jax.tree.map(lambda x: x * scale, _tree(step + 1))
    u_plain, s_plain = plain.update(grads, s_plain, params)
    u_grouped, s_grouped = grouped.update(grads, s_grouped, params)
    for a, b in zip(jax.tree.leaves((u_grouped, s_grouped)), jax.tree.leaves((u_plain, s_plain)),
                    strict=True):
      if clip:
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=0)
      else:
        np.testing.assert_array_equal(a, b)
    params = optax.apply_updates(params, u_plain)


def test_grouped_passes_a_bare_array_through():
  x = jnp.asarray(np.random.default_rng(0).standard_normal(7), jnp.float32)
  plain, grouped = optax.adam(1e-2), lg.grouped(optax.adam(1e-2))
  u_plain, _ = plain.update(x, plain.init(x), x)
  u_grouped, _ = grouped.update(x, grouped.init(x), x)
  np.testing.assert_array_equal(u_grouped, u_plain)


def test_grouped_mask_sees_leaf_shapes():
  """The wrapped mask sees shapes without the stack axis: 1-D scales are not decayed, matrices are."""
  groups = {"a:float32[3]": jnp.ones((4, 3)), "b:float32[5, 3]": jnp.ones((3, 5, 3))}
  assert lg.grouped_mask(ts.decay_mask)(groups) == {"a:float32[3]": False, "b:float32[5, 3]": True}


def test_train_step_on_a_repeating_stack_matches_the_plain_optimizer():
  """tiny with 3 layers (DSA+dense, delta+MoE, DSA+MoE: the two DSA layers' attention leaves and
  every layer's norms share groups): one jitted step with leaf groups
  (config.train.group_max_elements) gives the weights, moments and per-leaf checks of the step
  without (0).
  Not bitwise: the two programs differ, and XLA fuses some gradient reductions differently when
  their result feeds a stack (measured: the delta layers' conv_w gradients, ~1e-7 relative);
  given the same gradients the optimizer is bitwise (test_grouped_adamw_equals_plain_adamw)."""
  c = horizon.get_config("tiny")
  cfg = ModelConfig.from_config(c.model).replace(num_layers=3)
  tc = dataclasses.replace(ts.TrainConfig.from_config(c.train), grad_clip=1e6)  # no clipping
  assert tc.group_max_elements > 0  # the default
  rows = {k: jnp.asarray(v) for k, v in byte_corpus.lm_rows(
      byte_corpus.load_stdlib_bytes(), 0, 0, np.arange(2), 16).items()}
  results = []
  for group in (tc.group_max_elements, 0):
    tcg = dataclasses.replace(tc, group_max_elements=group)
    model = Horizon(cfg, rngs=nnx.Rngs(0))
    opt = ts.make_train_state(model, tcg)
    metrics = jax.device_get(ts.jit_train_step(model, opt, rows, tcg))
    results.append((metrics, nnx.state(model, nnx.Param), nnx.state(opt)))
  (m_g, p_g, o_g), (m_p, p_p, o_p) = results
  groups = lg.LeafGroups.of(p_g, tc.group_max_elements)
  assert max(len(m) for m in groups.members) > 1  # some roles do repeat across layers
  assert len(lg.LeafGroups.of(p_g, 0).keys) == groups.num_leaves
  assert m_g["finite"] and m_g["grad_finite"].shape == (groups.num_leaves,)
  np.testing.assert_array_equal(m_g["grad_finite"], m_p["grad_finite"])
  np.testing.assert_allclose(m_g["grad_norm"], m_p["grad_norm"], rtol=1e-6)
  assert jax.tree.structure(o_g) == jax.tree.structure(o_p)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path((p_g, o_g)), jax.tree.leaves((p_p, o_p)),
                          strict=True):
    assert_close(a, b, what=jax.tree_util.keystr(path))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_finite_is_all_isfinite(dtype):
  """`finite` (a sum of x * 0) agrees with all(isfinite) over any axes, for inf, -inf, NaN and the
  largest finite values (whose products with 0 are 0), and is True for integers."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((3, 5, 7)).astype(np.float32) * 1e3
  x[0, 1, 2], x[1, 4, 6], x[2, 0, 0] = np.inf, -np.inf, np.nan
  x[1, 0, 0] = x[2, 3, 3] = np.finfo(np.float32).max
  x = jnp.asarray(rng.integers(-9, 9, x.shape), dtype) if dtype == jnp.int32 else jnp.asarray(x).astype(dtype)
  for axis in (None, (1, 2), (0,), (2,)):
    want = jnp.all(jnp.isfinite(x), axis)
    np.testing.assert_array_equal(jax.jit(lg.finite, static_argnums=1)(x, axis), want)
  if dtype != jnp.int32:
    assert not bool(lg.finite(x)) and bool(lg.finite(x[:, :, 3:5][1:2]))


def test_apply_if_finite_is_optax_apply_if_finite():
  """Same updates and same state (optax.ApplyIfFiniteState) step by step as optax's, through finite
  steps, skipped non-finite ones and the give-up after max_consecutive_errors."""
  params = {"a": jnp.ones((4, 3)), "b": jnp.arange(5.0)}
  ours, theirs = lg.apply_if_finite(optax.adam(0.1), 2), optax.apply_if_finite(optax.adam(0.1), 2)
  s_ours, s_theirs = ours.init(params), theirs.init(params)
  assert jax.tree.structure(s_ours) == jax.tree.structure(s_theirs)
  rng = np.random.default_rng(1)
  for bad in (False, True, False, True, True, True, False):
    g = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
    if bad:
      g["b"] = g["b"].at[2].set(jnp.nan)
    u_ours, s_ours = jax.jit(ours.update)(g, s_ours, params)
    u_theirs, s_theirs = theirs.update(g, s_theirs, params)
    jax.tree.map(np.testing.assert_array_equal, (u_ours, s_ours), (u_theirs, s_theirs))
  assert int(s_ours.total_notfinite) == 4 and int(s_ours.notfinite_count) == 0


@pytest.mark.parametrize("max_elements", [None, 12])
def test_grouped_apply_is_apply_updates_of_the_grouped_optimizer(max_elements):
  """grouped_apply's new params and state equal optax.apply_updates of
  grouped(apply_if_finite(inner)).update, bit for bit, step by step: finite steps, skipped
  non-finite ones, and the give-up after max_consecutive_errors (NaN reaches the weights)."""
  tx = lg.grouped_apply_if_finite(_adamw(lg.grouped_mask(ts.decay_mask)), max_elements, 2)
  params = _tree(0)
  p_ours, s_ours = params, tx.init(params)
  p_theirs, s_theirs = params, tx.init(params)
  step = jax.jit(lambda g, s, p: lg.grouped_apply(tx, g, s, p))
  for i, bad in enumerate((False, True, False, True, True, True, False)):
    g = _tree(i + 1)
    if bad:
      g["blocks"][2]["w"] = g["blocks"][2]["w"].at[1, 1].set(jnp.nan)
    p_ours, s_ours = step(g, s_ours, p_ours)
    u, s_theirs = jax.jit(tx.update)(g, s_theirs, p_theirs)
    p_theirs = optax.apply_updates(p_theirs, u)
    assert jax.tree.structure((p_ours, s_ours)) == jax.tree.structure((p_theirs, s_theirs))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path((p_ours, s_ours)),
                            jax.tree.leaves((p_theirs, s_theirs)), strict=True):
      np.testing.assert_array_equal(a, b, err_msg=f"step {i}: {jax.tree_util.keystr(path)}")
  assert int(s_ours.total_notfinite) == 4 and not bool(jnp.isfinite(p_ours["blocks"][2]["w"]).all())


def test_apply_update_is_the_optimizers_update(monkeypatch):
  """train_step.apply_update leaves the weights, moments and step count of nnx's
  `optimizer.update(model, grads)` bit for bit (tiny, 3 layers, two updates on the same random
  gradients, a few leaves' zero), and the weights did move; under nnx.jit it does take the grouped
  path (not nnx's fallback)."""
  traced = []
  grouped_apply = lg.grouped_apply
  monkeypatch.setattr(lg, "grouped_apply", lambda *a: traced.append(1) or grouped_apply(*a))
  c = horizon.get_config("tiny")
  tc = ts.TrainConfig.from_config(c.train)
  assert tc.group_max_elements > 0
  cfg = ModelConfig.from_config(c.model).replace(num_layers=3)
  before = Horizon(cfg, rngs=nnx.Rngs(0))
  params = nnx.state(before, nnx.Param)
  rng = np.random.default_rng(5)  # NumPy draws: a jax.random draw per leaf shape compiles (~7 s)
  # Random gradients of every leaf's shape, the odd leaf exactly zero (as a router bias's is).
  grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape) * (p.size % 7 != 3), p.dtype),
                       params)
  results = []
  for ours in (True, False):
    model = Horizon(cfg, rngs=nnx.Rngs(0))
    opt = ts.make_train_state(model, tc)

    @nnx.jit
    def two_updates(m, o, g, ours=ours):
      for _ in range(2):  # the second update sees non-zero moments
        ts.apply_update(m, o, g) if ours else o.update(m, g)

    two_updates(model, opt, grads)
    results.append((nnx.state(model), nnx.state(opt)))
  (m_ours, o_ours), (m_nnx, o_nnx) = results
  assert int(o_ours["step"][...]) == 2 and isinstance(opt.tx, lg.GroupedSkip) and len(traced) == 2
  assert jax.tree.structure((m_ours, o_ours)) == jax.tree.structure((m_nnx, o_nnx))
  moved = 0
  for (path, a), b, b0 in zip(jax.tree_util.tree_leaves_with_path(m_ours), jax.tree.leaves(m_nnx),
                              jax.tree.leaves(nnx.state(before)), strict=True):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    moved += not np.array_equal(a, b0)
  assert moved >= sum(bool(np.any(g)) for g in jax.tree.leaves(grads)) > 70
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(o_ours), jax.tree.leaves(o_nnx), strict=True):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
