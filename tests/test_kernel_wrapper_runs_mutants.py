"""Pallas kernel wrappers (pallas_kernels/*/ops.py) run in interpret mode on tiny odd shapes, against
numpy references written out here: input conventions the mutation audit found unpinned (integer
segment resets, clipped slot indices)."""

import jax.numpy as jnp
import numpy as np

from pallas_kernels.delta_rule import chunk_gated_delta_rule
from pallas_kernels.indexer_topk import ops as topk_ops
from pallas_kernels.sparse_attention import ops as attn_ops
from tests.helpers import assert_close


def _numpy_delta_rule(q, k, v, g, beta, s0, reset):
  """Per token: zero the state where reset != 0, decay it by exp(g), then the delta-rule write."""
  s = s0.astype(np.float64).copy()
  o = np.zeros(v.shape, np.float64)
  for i in range(q.shape[1]):
    s[reset[:, i] != 0] = 0.0
    s = np.exp(g[:, i])[..., None, None] * s
    predicted = np.einsum("bhkv,bhk->bhv", s, k[:, i])
    s = s + k[:, i][..., None] * (beta[:, i][..., None] * (v[:, i] - predicted))[..., None, :]
    o[:, i] = np.einsum("bhkv,bhk->bhv", s, q[:, i])
  return o, s


def _delta_inputs(seed):
  rng = np.random.default_rng(seed)
  b, t, h, kd, vd = 1, 6, 2, 3, 2
  q = 0.4 * rng.standard_normal((b, t, h, kd)).astype(np.float32)
  k = rng.standard_normal((b, t, h, kd)).astype(np.float32)
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.standard_normal((b, t, h, vd)).astype(np.float32)
  g = -rng.uniform(0.05, 0.5, (b, t, h)).astype(np.float32)
  beta = rng.uniform(0.2, 0.9, (b, t, h)).astype(np.float32)
  return q, k, v, g, beta, rng.standard_normal((b, h, kd, vd)).astype(np.float32)


def test_delta_rule_integer_resets_start_segments_where_nonzero():
  """reset may be an integer array: any nonzero entry (-1 and 2 too) starts a segment, as True does.
  t=6 with chunks of 4: resets at tokens 1 and 2 (1 then -1: their counts must not cancel), one of 2
  on the second chunk's start, and a partial last chunk."""
  xs = _delta_inputs(3)
  reset = np.array([[0, 1, -1, 0, 2, 0]], np.int32)
  o, final = chunk_gated_delta_rule(*(jnp.asarray(x) for x in xs), jnp.asarray(reset), chunk_size=4,
                                    interpret=True)
  o_want, final_want = _numpy_delta_rule(*xs, reset)
  assert o.shape == (1, 6, 2, 2) and final.shape == (1, 2, 3, 2)
  assert_close(o, o_want.astype(np.float32), what="o")
  assert_close(final, final_want.astype(np.float32), what="final state")


def test_delta_rule_computes_in_float32_for_bf16_inputs():
  """bf16 q, k, g, beta (v and the state f32): the kernels compute in f32, so o and the final state
  match the f64 recurrence on the bf16 values to f32 accuracy (not bf16's)."""
  q, k, v, g, beta, s0 = _delta_inputs(4)
  bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, g, beta)]
  q, k, g, beta = (np.asarray(x, np.float32) for x in bf)
  o, final = chunk_gated_delta_rule(bf[0], bf[1], jnp.asarray(v), bf[2], bf[3], jnp.asarray(s0), chunk_size=4,
                                    interpret=True)
  o_want, final_want = _numpy_delta_rule(q, k, v, g, beta, s0, np.zeros((1, 6), bool))
  assert o.dtype == final.dtype == jnp.float32
  assert_close(o, o_want.astype(np.float32), what="o")
  assert_close(final, final_want.astype(np.float32), what="final state")


def test_sparse_attention_clips_valid_indices_into_range():
  """A valid index below 0 attends to key 0 and one past the end to the last key (the XLA path's
  clipped gather); invalid slots are ignored whatever their index. Dense numpy softmax per head."""
  rng = np.random.default_rng(5)
  b, t, h, c, p, s, scale = 1, 3, 2, 3, 2, 5, 0.5
  ql, qr = rng.standard_normal((b, t, h, c)), rng.standard_normal((b, t, h, p))
  lat, kr = rng.standard_normal((b, s, c)), rng.standard_normal((b, s, p))
  idx = np.array([[[-3, 2, 4], [7, 1, -1], [0, 9, 3]]], np.int32)
  valid = np.array([[[True, True, False], [True, True, True], [True, False, True]]])
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  out, p_sel = attn_ops.sparse_mqa_attention(f32(ql), f32(qr), f32(lat), f32(kr), jnp.asarray(idx),
                                             jnp.asarray(valid), scale, 4, interpret=True, backend="triton")
  rows = np.clip(idx, 0, s - 1)
  want_out, want_p = np.zeros((b, t, h, c)), np.zeros((b, t, 3))
  for i in range(t):
    keys = rows[0, i][valid[0, i]]
    logits = scale * (ql[0, i] @ lat[0, keys].T + qr[0, i] @ kr[0, keys].T)  # [h, n]
    prob = np.exp(logits - logits.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    want_out[0, i] = prob @ lat[0, keys]
    want_p[0, i, valid[0, i]] = prob.sum(0) / h
  assert_close(out, want_out.astype(np.float32), what="out_lat")
  assert_close(p_sel, want_p.astype(np.float32), what="p_sel")


def test_indexer_topk_scores_keys_past_the_first_chunk_multiple():
  """35 keys, key blocks of 32 in chunks of 16: the keys are padded to whole key blocks (64), not just
  to whole chunks (48), so keys 32..34 are scored. numpy: top 4 by (score desc, index asc), causal."""
  rng = np.random.default_rng(9)
  t, h, d, s, topk = 5, 2, 3, 35, 4
  q, w = rng.standard_normal((1, t, h, d)), rng.uniform(0.5, 1.0, (1, t, h))
  k = rng.standard_normal((1, s, d))
  k_pos = np.arange(s, dtype=np.int32)[None]
  q_pos = np.array([[3, 31, 32, 33, 34]], np.int32)
  seg_q, seg_k = np.zeros((1, t), np.int32), np.zeros((1, s), np.int32)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  idx, valid = topk_ops.blockwise_topk(f32(q), f32(w), f32(k), jnp.asarray(q_pos), jnp.asarray(seg_q),
                                       jnp.asarray(k_pos), jnp.asarray(seg_k), topk, 4, 8, interpret=True,
                                       backend="triton", block=topk_ops.BlockSizes(16, 32, 16))
  scores = np.einsum("th,tsh->ts", w[0], np.maximum(np.einsum("thd,sd->tsh", q[0], k[0]), 0.0))
  for i in range(t):
    allowed = [j for j in range(s) if j <= q_pos[0, i]]
    want = sorted(allowed, key=lambda j: (-scores[i, j], j))[:topk]
    assert bool(np.all(np.asarray(valid[0, i]))), f"query {i}: {topk} allowed keys at least"
    assert np.asarray(idx[0, i]).tolist() == want, f"query {i}"
