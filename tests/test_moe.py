"""Tests for the MoE: routing and aux losses (model/moe_routing.py), dropless experts
(model/moe_experts.py), the layer and its bias balancing (model/moe.py).

Fast paths are checked against plain references on random, odd-shaped f32
inputs: dropless experts vs running every expert on every token, routing vs a
brute-force numpy loop, the MoE layer vs a per-expert python loop.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.test_util import check_grads

from model import moe, moe_experts, moe_routing
from tests.helpers import assert_close

IMPLS = ("grouped", "gather", "ragged_dot", "blocked")


def _normal(key, shape, scale=1.0):
  return scale * jax.random.normal(key, shape, jnp.float32)


def _expert_inputs(seed, t, e, k, d, f):
  """Random tokens, distinct expert ids per token, positive combine weights, weights."""
  ks = jax.random.split(jax.random.key(seed), 6)
  x = _normal(ks[0], (t, d))
  idx = jnp.argsort(jax.random.uniform(ks[1], (t, e)), axis=-1)[:, :k].astype(jnp.int32)
  w = jax.random.uniform(ks[2], (t, k), jnp.float32, 0.1, 1.0)
  wg = _normal(ks[3], (e, d, f), d ** -0.5)
  wu = _normal(ks[4], (e, d, f), d ** -0.5)
  wd = _normal(ks[5], (e, f, d), f ** -0.5)
  return x, idx, w, wg, wu, wd


# (t, e, k, d, f, block); t = b * t for b=2, t=7 and odd others.
EXPERT_SHAPES = [(14, 8, 2, 13, 5, None), (14, 11, 3, 13, 7, 3), (21, 8, 3, 7, 6, 1)]


def _value_and_grads(fn, args, cot):
  """fn(*args) and the gradients of <fn(*args), cot> wrt x, weights, w_gate, w_up, w_down."""
  loss = lambda *a: jnp.sum(fn(*a) * cot)
  return jax.jit(lambda *a: (fn(*a), jax.grad(loss, argnums=(0, 2, 3, 4, 5))(*a)))(*args)


@pytest.mark.parametrize("t,e,k,d,f,block", EXPERT_SHAPES)
def test_dropless_matches_dense_reference(t, e, k, d, f, block):
  args = _expert_inputs(t * e + k, t, e, k, d, f)
  cot = _normal(jax.random.key(99), (t, d))
  y_ref, g_ref = _value_and_grads(lambda *a: moe_experts.dense_experts_reference(*a, jnp.float32), args, cot)
  for impl in IMPLS:
    fast = functools.partial(moe_experts.dropless_experts, dtype=jnp.float32, impl=impl, block=block)
    y, g = _value_and_grads(fast, args, cot)
    assert_close(y, y_ref, what=f"{impl} forward")
    for name, a, b in zip(("x", "weights", "w_gate", "w_up", "w_down"), g, g_ref, strict=True):
      assert_close(a, b, what=f"{impl} grad {name}")


def test_dropless_unbalanced_and_empty_experts():
  """Every token on the same two experts; the other experts get no rows."""
  x, _, w, wg, wu, wd = _expert_inputs(3, 10, 7, 2, 13, 5)
  idx = jnp.tile(jnp.array([[5, 2]], jnp.int32), (10, 1))
  ref = jax.jit(moe_experts.dense_experts_reference, static_argnums=6)(x, idx, w, wg, wu, wd, jnp.float32)
  for impl in IMPLS:
    fast = jax.jit(functools.partial(moe_experts.dropless_experts, dtype=jnp.float32, impl=impl))
    assert_close(fast(x, idx, w, wg, wu, wd), ref, what=impl)


def test_dropless_bfloat16_matches_reference():
  args = _expert_inputs(5, 14, 8, 2, 16, 8)
  args = tuple(a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in args)
  ref = jax.jit(moe_experts.dense_experts_reference, static_argnums=6)(*args, jnp.bfloat16)
  for impl in IMPLS:
    y = jax.jit(functools.partial(moe_experts.dropless_experts, dtype=jnp.bfloat16, impl=impl))(*args)
    assert y.dtype == jnp.bfloat16
    assert_close(y.astype(jnp.float32), ref.astype(jnp.float32), dtype="bfloat16", what=impl)


def test_dropless_bad_inputs():
  x, idx, w, wg, wu, wd = _expert_inputs(0, 6, 4, 2, 5, 3)
  with pytest.raises(ValueError, match="x_td"):
    moe_experts.dropless_experts(x[None], idx, w, wg, wu, wd, jnp.float32)
  with pytest.raises(ValueError, match="weights_tk"):
    moe_experts.dropless_experts(x, idx, w[:, :1], wg, wu, wd, jnp.float32)
  with pytest.raises(ValueError, match="w_down"):
    moe_experts.dropless_experts(x, idx, w, wg, wu, wd[:, :2], jnp.float32)
  with pytest.raises(ValueError, match="impl"):
    moe_experts.dropless_experts(x, idx, w, wg, wu, wd, jnp.float32, impl="megablocks")


# ---- routing -----------------------------------------------------------------


def np_select(scores, bias, k, groups, topk_groups):
  """Brute-force group-limited top-k, one token at a time (float64)."""
  s = np.asarray(scores, np.float64) + np.asarray(bias, np.float64)
  n, e = s.shape
  per = e // groups
  out = np.zeros((n, k), np.int64)
  for i in range(n):
    row = s[i].copy()
    if groups > 1:
      gscore = [np.sort(row[g * per:(g + 1) * per])[::-1][:2].sum() for g in range(groups)]
      best = np.argsort(-np.array(gscore), kind="stable")[:topk_groups]
      for g in range(groups):
        if g not in best:
          row[g * per:(g + 1) * per] = -np.inf
    out[i] = np.argsort(-row, kind="stable")[:k]
  return out


@pytest.mark.parametrize("e,k,groups,topk_groups", [(12, 3, 4, 2), (6, 2, 6, 3), (11, 3, 1, 1),
                                                    (15, 4, 5, 2)])
def test_group_limited_selection_matches_numpy(e, k, groups, topk_groups):
  ks = jax.random.split(jax.random.key(e * 10 + k), 2)
  scores = jax.nn.sigmoid(_normal(ks[0], (2, 7, e)))
  bias = _normal(ks[1], (e,), 0.3)
  idx = jax.jit(moe_routing.select_experts, static_argnums=(2, 3, 4))(scores, bias, k, groups, topk_groups)
  assert idx.shape == (2, 7, k) and idx.dtype == jnp.int32
  expected = np_select(scores.reshape(-1, e), bias, k, groups, topk_groups).reshape(2, 7, k)
  np.testing.assert_array_equal(np.asarray(idx), expected)
  # Selected experts lie in at most topk_groups groups.
  n_groups_used = [len(set(r // (e // groups))) for r in np.asarray(idx).reshape(-1, k)]
  assert max(n_groups_used) <= topk_groups


def test_select_experts_bad_args():
  scores = jnp.ones((3, 8)) * 0.5
  with pytest.raises(ValueError, match="groups=3"):
    moe_routing.select_experts(scores, jnp.zeros(8), 2, groups=3, topk_groups=1)
  with pytest.raises(ValueError, match="k=5"):
    moe_routing.select_experts(scores, jnp.zeros(8), 5, groups=4, topk_groups=2)
  with pytest.raises(ValueError, match="bias shape"):
    moe_routing.select_experts(scores, jnp.zeros(7), 2)


def _moe(cfg, seed=0, impl="auto"):
  return moe.MoE(cfg, rngs=nnx.Rngs(seed), impl=impl)


def _x(cfg, b=2, t=7, seed=1):
  return _normal(jax.random.key(seed), (b, t, cfg.d_model))


def test_bias_changes_selection_not_combine_weights(tiny_cfg):
  cfg = tiny_cfg.replace(routed_scaling=1.7, router_groups=1, router_topk_groups=1)
  m = _moe(cfg)
  x = _x(cfg)
  route = nnx.jit(lambda m, x: m.route(x))
  _, scores, idx0, w0 = route(m, x)
  bias = np.zeros(cfg.num_experts, np.float32)
  bias[3] = 10.0  # forces expert 3 into every token's top-k
  m.router_bias[...] = jnp.asarray(bias)
  _, scores_b, idx, w = route(m, x)
  assert_close(scores_b, scores, what="scores do not see the bias")
  assert np.all(np.any(np.asarray(idx) == 3, axis=-1))
  assert not np.array_equal(np.asarray(idx), np.asarray(idx0))
  s = np.asarray(scores, np.float64)
  sel = np.take_along_axis(s, np.asarray(idx), -1)
  expected = sel / sel.sum(-1, keepdims=True) * 1.7
  assert_close(w, expected, what="combine weights = unbiased normalised scores")


# ---- MoE layer vs a per-expert python reference -------------------------------


def _ref_scores(m, x):
  logits = jnp.einsum("btd,de->bte", x, m.w_router[...])
  if m.cfg.router_score == "sigmoid":
    return logits, jax.nn.sigmoid(logits)
  return logits, jax.nn.softmax(logits, -1)


def moe_reference(m, x, idx):
  """Plain MoE forward: f32 router, given ids, every expert looped, shared MLP."""
  cfg = m.cfg
  _, scores = _ref_scores(m, x)
  w = jnp.take_along_axis(scores, idx, -1)
  if cfg.norm_topk_prob:
    w = w / jnp.sum(w, -1, keepdims=True)
  w = w * cfg.routed_scaling
  y = jnp.zeros_like(x)
  for e in range(cfg.num_experts):
    h = jax.nn.silu(x @ m.w_gate[e]) * (x @ m.w_up[e])
    c = jnp.sum(jnp.where(idx == e, w, 0.0), -1, keepdims=True)
    y = y + c * (h @ m.w_down[e])
  if cfg.num_shared_experts:
    s = m.shared
    y = y + (jax.nn.silu(x @ s.w_gate[...]) * (x @ s.w_up[...])) @ s.w_down[...]
  return y


def _np_idx(m, x):
  cfg = m.cfg
  _, scores = nnx.jit(_ref_scores)(m, x)
  e = cfg.num_experts
  idx = np_select(np.asarray(scores).reshape(-1, e), np.asarray(m.router_bias[...]),
                  cfg.experts_per_token, cfg.router_groups, cfg.router_topk_groups)
  return jnp.asarray(idx.reshape(x.shape[:2] + (-1,)), jnp.int32)


CFG_VARIANTS = {
    "tiny": {},
    "e11_k3_d13": dict(d_model=13, num_experts=11, experts_per_token=3, expert_dim=5,
                       router_groups=1, router_topk_groups=1, routed_scaling=2.5),
    "softmax": dict(router_score="softmax", norm_topk_prob=False, num_shared_experts=0),
    "softmax_norm": dict(router_score="softmax", norm_topk_prob=True, experts_per_token=3,
                         router_groups=4, router_topk_groups=2),
}


def _fwd_and_grads(fn, m, x, cot):
  """fn(m, x) and the grads of <fn(m, x), cot> wrt m's nnx.Params and x, jitted."""
  @nnx.jit
  def run(mod, x):
    loss = lambda mod, x: jnp.sum(fn(mod, x) * cot)
    return fn(mod, x), nnx.grad(loss, argnums=(0, 1))(mod, x)
  return run(m, x)


@pytest.mark.parametrize("variant", sorted(CFG_VARIANTS))
def test_moe_matches_reference_forward_and_grads(tiny_cfg, variant):
  cfg = tiny_cfg.replace(**CFG_VARIANTS[variant])
  m = _moe(cfg, seed=3)
  m.router_bias[...] = _normal(jax.random.key(4), (cfg.num_experts,), 0.05)
  x = _x(cfg)
  idx = _np_idx(m, x)
  np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, x: m.route(x)[2])(m, x)), idx)
  cot = _normal(jax.random.key(5), x.shape)
  y_ref, (g_ref, gx_ref) = _fwd_and_grads(lambda mod, x: moe_reference(mod, x, idx), m, x, cot)
  flat_ref = dict(nnx.to_flat_state(g_ref))
  assert ("router_bias",) not in flat_ref
  for impl in IMPLS:
    m.impl = impl
    y, (g, gx) = _fwd_and_grads(lambda mod, x: mod(x)[0], m, x, cot)
    assert_close(y, y_ref, what=f"{impl} forward")
    assert_close(gx, gx_ref, what=f"{impl} grad x")
    flat = nnx.to_flat_state(g)
    assert {p for p, _ in flat} == set(flat_ref)
    for path, v in flat:
      assert_close(v[...], flat_ref[path][...], what=f"{impl} grad {path}")


def test_moe_check_grads(tiny_cfg):
  cfg = tiny_cfg.replace(d_model=13, expert_dim=5, num_experts=8, experts_per_token=2)
  m = _moe(cfg, seed=7)
  graphdef, params, rest = nnx.split(m, nnx.Param, ...)
  x = _x(cfg, b=1, t=5, seed=8)

  def f(x, params):
    return nnx.merge(graphdef, params, rest)(x)[0]

  check_grads(jax.jit(f), (x, params), order=1, modes=["rev"], eps=1e-3)


# ---- aux outputs ----------------------------------------------------------------


def np_seq_aux(scores, idx):
  scores, idx = np.asarray(scores, np.float64), np.asarray(idx)
  b, t, e = scores.shape
  k = idx.shape[-1]
  total = 0.0
  for i in range(b):
    counts = np.array([np.sum(idx[i] == j) for j in range(e)], np.float64)
    f = counts * e / (k * t)
    p = (scores[i] / scores[i].sum(-1, keepdims=True)).mean(0)
    total += np.sum(f * p)
  return total / b


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_aux_load_and_losses_match_numpy(tiny_cfg, score):
  cfg = tiny_cfg.replace(num_experts=11, experts_per_token=3, router_groups=1, router_topk_groups=1,
                         router_score=score)
  m = _moe(cfg, seed=11)
  x = _x(cfg, b=3, t=5, seed=12)
  aux, (logits, scores, idx, _) = nnx.jit(lambda m, x: (m(x)[1], m.route(x)))(m, x)
  load = np.bincount(np.asarray(idx).reshape(-1), minlength=cfg.num_experts)
  assert aux["load"].dtype == jnp.float32 and aux["load"].shape == (11,)
  assert float(aux["load"].sum()) == 3 * 5 * 3
  np.testing.assert_array_equal(np.asarray(aux["load"]), load)
  lg = np.asarray(logits, np.float64)
  mx = lg.max(-1, keepdims=True)
  lse = (mx + np.log(np.exp(lg - mx).sum(-1, keepdims=True)))[..., 0]
  assert_close(aux["z_loss"], np.mean(lse ** 2), what="z_loss")
  assert_close(aux["seq_aux_loss"], np_seq_aux(scores, idx), what="seq_aux_loss")


def test_aux_statistics_count_only_valid_tokens(tiny_cfg):
  """With a padding mask, load and each row's balance loss are computed on the real tokens
  alone (the row's prefix), whatever the padding holds; padding adds 0 to z_loss and a row of
  padding adds 0 to seq_aux_loss, both still averaged over every position / row."""
  cfg = tiny_cfg.replace(num_experts=11, experts_per_token=3, router_groups=1, router_topk_groups=1)
  m = _moe(cfg, seed=21)
  x = _x(cfg, b=4, t=7, seed=22)
  lengths = np.array([7, 3, 5, 0])
  valid = jnp.asarray(np.arange(7)[None, :] < lengths[:, None])
  aux, (logits, scores, idx, _) = nnx.jit(lambda m, x, v: (m(x, None, v)[1], m.route(x)))(m, x, valid)
  idx, lg, sc = np.asarray(idx), np.asarray(logits, np.float64), np.asarray(scores, np.float64)
  real = np.concatenate([idx[i, :n].reshape(-1) for i, n in enumerate(lengths)])
  np.testing.assert_array_equal(np.asarray(aux["load"]), np.bincount(real, minlength=11))
  lse = np.log(np.exp(lg).sum(-1))
  assert_close(aux["z_loss"], sum(np.sum(lse[i, :n] ** 2) for i, n in enumerate(lengths)) / (4 * 7),
               what="masked z_loss")
  per_row = [np_seq_aux(sc[i:i + 1, :n], idx[i:i + 1, :n]) for i, n in enumerate(lengths) if n]
  assert_close(aux["seq_aux_loss"], np.sum(per_row) / 4, what="masked seq_aux_loss")
  unmasked = nnx.jit(lambda m, x: m(x)[1])(m, x)
  everything = nnx.jit(lambda m, x, v: m(x, None, v)[1])(m, x, jnp.ones((4, 7), bool))
  for key in ("load", "z_loss", "seq_aux_loss"):
    np.testing.assert_allclose(np.asarray(everything[key]), np.asarray(unmasked[key]), rtol=1e-6, err_msg=key)
  with pytest.raises(ValueError, match="valid must be"):
    m(x, None, valid[:, :5])


def test_aux_losses_check_grads():
  logits = _normal(jax.random.key(13), (2, 5, 7), 2.0)
  idx = moe_routing.select_experts(jax.nn.sigmoid(logits), jnp.zeros(7), 2)
  check_grads(jax.jit(lambda lg: moe_routing.sequence_aux_loss(jax.nn.sigmoid(lg), idx)), (logits,),
              order=1, modes=["rev"], eps=1e-3)
  check_grads(jax.jit(moe_routing.router_z_loss), (logits,), order=1, modes=["rev"], eps=1e-3)


def test_balanced_seq_aux_loss_is_one():
  """Uniform scores and perfectly even routing give exactly 1."""
  e, k, t = 6, 2, 9
  idx = jnp.asarray(np.arange(t * k).reshape(1, t, k) % e, jnp.int32)
  assert_close(moe_routing.sequence_aux_loss(jnp.full((1, t, e), 0.3), idx), 1.0, what="balanced")


# ---- bias balancing ------------------------------------------------------------


def test_update_bias_sign_and_not_trained(tiny_cfg):
  m = _moe(tiny_cfg)
  load = jnp.array([9.0, 1.0, 4.0, 4.0, 0.0, 6.0, 4.0, 4.0])  # mean 4
  m.update_bias(load, 0.01)
  np.testing.assert_allclose(np.asarray(m.router_bias[...]),
                             [-0.01, 0.01, 0, 0, 0.01, -0.01, 0, 0], rtol=0, atol=1e-9)
  assert isinstance(m.router_bias, moe.RouterBias) and not isinstance(m.router_bias, nnx.Param)
  assert "router_bias" not in nnx.state(m, nnx.Param)
  # An optimizer step over nnx.Param leaves the bias alone.
  before = np.asarray(m.router_bias[...]).copy()
  opt = nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param)
  x = _x(tiny_cfg)
  grads = nnx.jit(nnx.grad(lambda mod: jnp.sum(mod(x)[0] ** 2)))(m)
  assert "router_bias" not in grads
  w_before = np.asarray(m.w_router[...]).copy()
  opt.update(m, grads)
  np.testing.assert_array_equal(np.asarray(m.router_bias[...]), before)
  assert not np.array_equal(np.asarray(m.w_router[...]), w_before)
  with pytest.raises(ValueError, match="load shape"):
    m.update_bias(jnp.ones(3), 0.01)


def test_bias_updates_balance_a_skewed_router(tiny_cfg):
  cfg = tiny_cfg.replace(router_groups=1, router_topk_groups=1)
  m = _moe(cfg, seed=2)
  skew = np.zeros((cfg.d_model, cfg.num_experts), np.float32)
  skew[:, :2] = 0.5  # experts 0 and 1 are favoured by every token
  m.w_router[...] = m.w_router[...] + jnp.asarray(skew)
  x = jnp.abs(_x(cfg, b=4, t=16, seed=6))
  route = nnx.jit(lambda mod, x: mod(x)[1]["load"])
  first = np.asarray(route(m, x))
  for _ in range(60):
    m.update_bias(route(m, x), 0.02)
  last = np.asarray(route(m, x))
  assert first.max() > 2 * first.mean()
  assert np.abs(last - last.mean()).sum() < 0.5 * np.abs(first - first.mean()).sum()
  assert float(m.router_bias[0]) < 0 and float(m.router_bias[1]) < 0


def test_update_router_biases_over_model(tiny_cfg):
  class Two(nnx.Module):
    def __init__(self):
      self.blocks = nnx.List([_moe(tiny_cfg, seed=0), _moe(tiny_cfg, seed=1)])

  model = Two()
  found = moe.find_moe_modules(model)
  assert list(found) == [("blocks", 0), ("blocks", 1)]
  e = tiny_cfg.num_experts
  loads = [jnp.arange(e, dtype=jnp.float32), jnp.arange(e, dtype=jnp.float32)[::-1]]
  moe.update_router_biases(list(found.values()), loads, 0.5)
  b0 = np.asarray(model.blocks[0].router_bias[...])
  b1 = np.asarray(model.blocks[1].router_bias[...])
  np.testing.assert_array_equal(b0, 0.5 * np.sign(np.mean(np.arange(e)) - np.arange(e)))
  np.testing.assert_array_equal(b1, b0[::-1])
  with pytest.raises(ValueError, match="one load per MoE layer"):
    moe.update_router_biases(list(found.values()), loads[:1], 0.5)


def test_moe_bad_inputs(tiny_cfg):
  m = _moe(tiny_cfg)
  with pytest.raises(ValueError, match="d_model=56"):
    m(jnp.ones((2, 3, 5)))
  with pytest.raises(ValueError, match="impl"):
    moe.MoE(tiny_cfg, rngs=nnx.Rngs(0), impl="dense")


def test_moe_param_axes(tiny_cfg):
  m = _moe(tiny_cfg)
  assert m.w_router.axes == ("embed", "expert")
  assert m.w_gate.axes == ("expert", "embed", "mlp") and m.w_up.axes == ("expert", "embed", "mlp")
  assert m.w_down.axes == ("expert", "mlp", "embed")
  assert m.router_bias[...].dtype == jnp.float32
  e, d, f = tiny_cfg.num_experts, tiny_cfg.d_model, tiny_cfg.expert_dim
  assert m.w_gate.shape == (e, d, f) and m.w_down.shape == (e, f, d)
  assert m.shared.w_gate.shape == (d, tiny_cfg.num_shared_experts * f)
  assert _moe(tiny_cfg.replace(num_shared_experts=0)).shared is None
