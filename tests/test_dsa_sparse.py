"""Tests for model/attention/sparse.py: the blockwise indexer top-k and the sparse MQA attention
Gated DSA runs on, each checked against the kernels' plain references (pallas_kernels/*/reference.py)
on random, odd-sized f32 inputs, forward and gradients. The layer itself: tests/test_dsa.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from model.attention import sparse
from pallas_kernels.indexer_topk import reference as topk_ref
from pallas_kernels.sparse_attention import reference as attn_ref
from tests.helpers import assert_close, normal_data, packed_segments, row_positions


def _indexer_inputs(key, b, t, s, h=3, k=5):
  return normal_data(key, (b, t, h, k)), normal_data(key + 1, (b, t, h)), normal_data(key + 2, (b, s, k))


# ---------------------------------------------------------------------------
# sparse.py vs the kernels' plain references
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("b,t,s,topk,qb,kb", [
    (2, 37, 37, 16, 8, 16), (2, 37, 37, 16, 16, 8), (1, 37, 37, 16, 5, 7),
    (1, 23, 41, 9, 64, 64), (2, 19, 19, 3, 4, 32)])
def test_blockwise_topk_matches_dense(b, t, s, topk, qb, kb):
  q, w, k = _indexer_inputs(0, b, t, s)
  q_pos, k_pos = row_positions(b, t) + (s - t), row_positions(b, s)
  q_seg = packed_segments(b, t, [[9], [20]][:b])
  k_seg = packed_segments(b, s, [[9 + s - t], [20 + s - t]][:b])

  @jax.jit
  def run(q, w, k):
    idx, valid = sparse.blockwise_topk(q, w, k, q_pos, q_seg, k_pos, k_seg, topk, qb, kb)
    mask = topk_ref.allowed_mask(q_pos, q_seg, k_pos, k_seg)
    scores = topk_ref.indexer_scores_dense(q, w, k)
    ref_vals = jax.lax.top_k(jnp.where(mask, scores, -jnp.inf), topk)[0]
    return idx, valid, mask, ref_vals, jnp.take_along_axis(scores, idx, axis=-1)

  idx, valid, mask, ref_vals, got = run(q, w, k)
  assert idx.shape == (b, t, topk) and idx.dtype == jnp.int32 and valid.shape == (b, t, topk)
  n_allowed = mask.sum(-1)
  np.testing.assert_array_equal(valid.sum(-1), jnp.minimum(n_allowed, topk))
  assert bool(jnp.all(jnp.take_along_axis(mask, idx, axis=-1) | ~valid)), "selected a masked key"
  got_sorted = -jnp.sort(-jnp.where(valid, got, -jnp.inf), axis=-1)
  ok = jnp.isfinite(ref_vals)
  np.testing.assert_array_equal(jnp.isfinite(got_sorted), ok)
  assert_close(jnp.where(ok, got_sorted, 0), jnp.where(ok, ref_vals, 0), what="top-k score values")
  for r in range(b):  # the selected keys are distinct
    for i in range(t):
      sel = np.asarray(idx[r, i])[np.asarray(valid[r, i])]
      assert len(set(sel.tolist())) == len(sel)


def _reference_topk_mask(scores, allowed, topk):
  """lax.top_k of where(allowed, scores, -inf) scattered into a mask (valid slots only)."""
  vals, ids = jax.lax.top_k(jnp.where(allowed, scores, -jnp.inf), min(topk, scores.shape[-1]))
  hit = (ids[..., None] == jnp.arange(scores.shape[-1])) & (vals > -jnp.inf)[..., None]
  return jnp.any(hit, axis=-2)


@pytest.mark.parametrize("shape,topk", [((2, 37, 41), 9), ((3, 5, 64), 17), ((1, 4, 3, 29), 1),
                                        ((2, 23, 23), 22)])
def test_topk_mask_equals_lax_top_k_with_ties(shape, topk):
  """The bisection selects lax.top_k's set: exact ties (zeros of both signs, repeated values) go
  to lower positions, -0.0 ranks below +0.0 as in lax.top_k's total order; rows with at most topk
  allowed entries keep all of them, a row with none selects nothing."""
  rng = np.random.default_rng(sum(shape) + topk)
  scores = rng.standard_normal(shape).astype(np.float32)
  r = rng.random(shape)
  scores[r < 0.3] = 0.0
  scores[(r >= 0.3) & (r < 0.4)] = -0.0
  scores[(r >= 0.4) & (r < 0.5)] = 1.25  # a repeated positive value
  scores[(r >= 0.5) & (r < 0.55)] = -3e38  # near the bottom of the f32 range
  allowed = rng.random(shape) < 0.8
  allowed[..., 0, :] = False  # no allowed entry
  allowed[..., 1, :] = np.arange(shape[-1]) < topk  # exactly topk
  scores, allowed = jnp.asarray(scores), jnp.asarray(allowed)
  got = jax.jit(sparse.topk_mask, static_argnums=2)(scores, allowed, topk)
  want = jax.jit(_reference_topk_mask, static_argnums=2)(scores, allowed, topk)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got.sum(-1), np.minimum(np.asarray(allowed).sum(-1), topk))
  assert int(got.sum()) > 0 and not bool(jnp.any(got & ~allowed))


def test_topk_mask_bad_arguments():
  x = jnp.ones((2, 5))
  with pytest.raises(ValueError, match="topk=0"):
    sparse.topk_mask(x, x > 0, 0)
  with pytest.raises(ValueError, match="same shape"):
    sparse.topk_mask(x, (x > 0)[:, :4], 2)


def test_blockwise_topk_more_slots_than_keys_and_cache_slots():
  """topk > allowed keys: extra slots invalid; k_seg < 0 (unfilled cache) never picked."""
  b, t, s = 2, 3, 29
  q, w, k = _indexer_inputs(10, b, t, s)
  lengths = jnp.array([11, 17])
  q_pos = lengths[:, None] - t + jnp.arange(t)
  k_pos = row_positions(b, s)
  k_seg = jnp.where(k_pos < lengths[:, None], 0, -1)
  topk = jax.jit(sparse.blockwise_topk, static_argnums=(7, 8, 9))
  idx, valid = topk(q, w, k, q_pos, jnp.zeros((b, t), jnp.int32), k_pos, k_seg, 32, 2, 8)
  np.testing.assert_array_equal(valid.sum(-1), q_pos + 1)
  assert bool(jnp.all(jnp.where(valid, idx <= q_pos[..., None], True)))
  assert bool(jnp.all(jnp.where(valid, 0, idx) == 0))


def _selected_mask(idx, valid, s):
  return jnp.any((idx[..., None] == jnp.arange(s)) & valid[..., None], axis=2)


def _mqa_case(b=2, t=37, s=37, h=3, c=7, p=4, topk=16, seed=20):
  q_lat, q_rope = normal_data(seed, (b, t, h, c)), normal_data(seed + 1, (b, t, h, p))
  latent, k_rope = normal_data(seed + 2, (b, s, c)), normal_data(seed + 3, (b, s, p))
  qi, wi, ki = _indexer_inputs(seed + 4, b, t, s)
  q_seg = packed_segments(b, t, [[12], [30]][:b]).at[0, -2:].set(-1)  # padded queries: no key
  k_seg = q_seg if s == t else jnp.zeros((b, s), jnp.int32)
  topk_fn = jax.jit(sparse.blockwise_topk, static_argnums=(7, 8, 9))
  idx, valid = topk_fn(qi, wi, ki, row_positions(b, t), q_seg, row_positions(b, s), k_seg, topk, 8, 16)
  return (q_lat, q_rope, latent, k_rope), idx, valid


@pytest.mark.parametrize("case,qb", [({}, 8), ({}, 5), ({}, 64), (
    {"b": 1, "t": 23, "s": 41, "h": 5, "c": 11, "p": 3, "topk": 9, "seed": 30}, 7)])
def test_sparse_mqa_matches_dense_on_selected_set(case, qb):
  args, idx, valid = _mqa_case(**case)
  s, scale = args[2].shape[1], 0.37
  mask = _selected_mask(idx, valid, s)
  cot = normal_data(99, args[0].shape)

  cot_p = normal_data(98, idx.shape)

  def fast(*a):
    return sparse.sparse_mqa_attention(*a, idx, valid, scale, qb)

  def ref(*a):
    out, p = attn_ref.dense_mqa_attention(*a, mask, scale)
    return out, jnp.where(valid, jnp.take_along_axis(p, idx, axis=-1), 0.0)

  def run(f):
    loss = lambda *a: (jnp.sum(f(*a)[0] * cot) + jnp.sum(f(*a)[1] * cot_p), f(*a))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*args)

  (_, (out, p_sel)), g = run(fast)
  (_, (out_r, p_r)), g_r = run(ref)
  assert_close(out, out_r, what="out_lat")
  assert_close(p_sel, p_r, what="p_sel")
  if not case:
    assert float(jnp.abs(out[0, -2:]).max()) == 0.0  # rows with no valid slot
  np.testing.assert_allclose(p_sel.sum(-1)[valid.any(-1)], 1.0, rtol=1e-5)
  for name, a, e in zip(("q_lat", "q_rope", "latent", "k_rope"), g, g_r, strict=True):
    assert_close(a, e, what=f"grad {name}")


def test_sparse_mqa_check_grads():
  args, idx, valid = _mqa_case(b=1, t=5, s=6, h=2, c=3, p=2, topk=4, seed=40)
  f = lambda *a: sparse.sparse_mqa_attention(*a, idx, valid, 0.5, 2)[0]
  check_grads(jax.jit(f), args, order=1, modes=["rev"], eps=1e-3)


def test_selected_indexer_scores_matches_dense():
  b, t, s = 2, 13, 17
  q, w, k = _indexer_inputs(50, b, t, s)
  idx = jnp.asarray(np.random.default_rng(51).integers(0, s, (b, t, 6), np.int32))
  cot = normal_data(52, (b, t, 6))
  fast = lambda q, w, k: sparse.selected_indexer_scores(q, w, k, idx, 4)
  ref = lambda q, w, k: jnp.take_along_axis(topk_ref.indexer_scores_dense(q, w, k), idx, axis=-1)
  def run(f):
    loss = lambda *a: (jnp.sum(f(*a) * cot), f(*a))
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, w, k)

  (got, g), (want, g_r) = run(fast), run(ref)
  assert_close(got[1], want[1], what="scores")
  for a, e in zip(g, g_r, strict=True):
    assert_close(a, e, what="score grads")


def _indexer_kl_reference(p, logits, mask):
  """KL(p || softmax over mask) per row and its gradient wrt the logits, in float64 loops."""
  b, t, n = p.shape
  loss, grad, rows = 0.0, np.zeros((b, t, n)), 0
  for i in range(b):
    for j in range(t):
      m = mask[i, j]
      if not m.any():
        continue
      rows += 1
      z = logits[i, j][m].astype(np.float64)
      logq = z - z.max() - np.log(np.sum(np.exp(z - z.max())))
      pm = p[i, j][m].astype(np.float64)
      nz = pm > 0
      loss += np.sum(pm[nz] * (np.log(pm[nz]) - logq[nz]))
      grad[i, j][m] = np.exp(logq) * pm.sum() - pm  # d/dz of -sum p logq
  return loss / rows, grad / rows


def test_indexer_kl_matches_reference():
  """Value and logits gradient of the indexer KL: masked entries, a fully masked row (left out of
  the mean) and target entries that are exactly zero (no 0 * log 0 NaN)."""
  b, t, n = 2, 5, 7
  rng = np.random.default_rng(60)
  mask = rng.random((b, t, n)) < 0.7
  mask[:, :, 0] = True
  mask[1, 3] = False
  p = np.where(mask, rng.random((b, t, n)), 0.0).astype(np.float32)
  p[0, :, 0] = 0.0  # allowed, but no target mass
  p = p / np.maximum(p.sum(-1, keepdims=True), 1e-30)
  logits = normal_data(61, (b, t, n))
  loss, grad = jax.jit(jax.value_and_grad(sparse.indexer_kl, argnums=1))(jnp.asarray(p), logits,
                                                                        jnp.asarray(mask))
  want_loss, want_grad = _indexer_kl_reference(p, np.asarray(logits), mask)
  assert_close(loss, want_loss, what="indexer kl")
  assert_close(grad, want_grad, what="indexer kl grad")


def test_sparse_bad_shapes():
  q, w, k = _indexer_inputs(0, 1, 5, 5)
  pos = row_positions(1, 5)
  with pytest.raises(ValueError, match="w_idx"):
    sparse.blockwise_topk(q, w[:, :, :2], k, pos, pos, pos, pos, 2, 4, 4)
  with pytest.raises(ValueError, match="k_pos"):
    sparse.blockwise_topk(q, w, k, pos, pos, pos[:, :3], pos, 2, 4, 4)
  with pytest.raises(ValueError, match="topk"):
    sparse.blockwise_topk(q, w, k, pos, pos, pos, pos, 0, 4, 4)
  (ql, qr, lat, kr), idx, valid = _mqa_case(b=1, t=5, s=6, h=2, c=3, p=2, topk=4)
  with pytest.raises(ValueError, match="idx and valid"):
    sparse.sparse_mqa_attention(ql, qr, lat, kr, idx[:, :3], valid, 1.0, 2)
  with pytest.raises(ValueError, match="k_rope"):
    sparse.sparse_mqa_attention(ql, qr, lat, kr[..., :1], idx, valid, 1.0, 2)
