"""The indexer top-k's contract: argument checks, block-skip plan and plain maths.

DeepSeek Sparse Attention (DeepSeek-AI, "DeepSeek-V3.2-Exp: Boosting
Long-Context Efficiency with DeepSeek Sparse Attention", 2025) lets each query
attend to the `topk` allowed keys with the highest lightning-indexer score
I[t,s] = sum_h w[t,h] relu(q[t,h] . k[s]). Key s is allowed for query t iff
k_seg[s] == q_seg[t], k_seg[s] >= 0 and k_pos[s] <= q_pos[t] (a negative
k_seg marks an unfilled cache slot).

Two fast paths compute that selection: the Pallas kernel (ops.py) and the
model's blockwise XLA path (model/attention/sparse.py:blockwise_topk). This
module is what both must equal and what they share:

* `check_topk_args`: the argument checks of their common signature.
* `allowed_mask` (per key pair) and `needed_blocks` (per block pair, a
  superset): which keys may be selected, so both paths skip the same blocks.
* `indexer_scores_dense` and `dense_topk`: the plain definition, the full
  [b, t, s] score matrix, masked, then one lax.top_k (small shapes only; the
  model's dense warm-up stage uses the scores and the mask too).

Only jax: importing this module loads no Pallas.

Einsum legend: b batch, t query, s key, h indexer heads, k indexer head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import need, positive_int

_INT_MAX = jnp.iinfo(jnp.int32).max
_INT_MIN = jnp.iinfo(jnp.int32).min


def check_topk_args(q_idx, w_idx, k_idx, q_pos, q_seg, k_pos, k_seg, topk, query_block, key_block):
  """Raises a ValueError naming the argument unless the shapes, dtypes and sizes fit together.

  Args: as `blockwise_topk` (q_idx [b, t, h, k], w_idx [b, t, h], k_idx [b, s, k],
  q_pos / q_seg [b, t] int, k_pos / k_seg [b, s] int, positive int topk and blocks).
  """
  need(q_idx.ndim == 4, f"blockwise_topk: q_idx must be [b, t, heads, dim], got shape {q_idx.shape}.")
  b, t, h, k = q_idx.shape
  need(b > 0 and t > 0 and k_idx.ndim == 3 and k_idx.shape[1] > 0,
       f"blockwise_topk: need at least one query and one key, got q_idx {q_idx.shape}, "
       f"k_idx {k_idx.shape}.")
  need(w_idx.shape == (b, t, h),
       f"blockwise_topk: w_idx must be [b, t, heads]={(b, t, h)}, got {w_idx.shape}.")
  need(k_idx.ndim == 3 and k_idx.shape[0] == b and k_idx.shape[2] == k,
       f"blockwise_topk: k_idx must be [b={b}, s, dim={k}], got {k_idx.shape}.")
  s = k_idx.shape[1]
  for name, arr, want in (("q_pos", q_pos, (b, t)), ("q_seg", q_seg, (b, t)),
                          ("k_pos", k_pos, (b, s)), ("k_seg", k_seg, (b, s))):
    need(arr.shape == want, f"blockwise_topk: {name} must have shape {want}, got {arr.shape}.")
    need(jnp.issubdtype(arr.dtype, jnp.integer),
         f"blockwise_topk: {name} must be an integer array, got {arr.dtype}.")
  for name, val in (("topk", topk), ("query_block", query_block), ("key_block", key_block)):
    need(positive_int(val) is not None, f"blockwise_topk: {name}={val!r} must be a positive int.")


def allowed_mask(q_pos: jax.Array, q_seg: jax.Array, k_pos: jax.Array, k_seg: jax.Array) -> jax.Array:
  """Dense mask [b, t, s]: same segment, key not in the future, k_seg >= 0."""
  same = k_seg[:, None, :] == q_seg[:, :, None]
  return same & (k_seg[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos[:, :, None])


def _block_stats(pos: jax.Array, seg: jax.Array, block: int):
  """Per block (over batch too): min/max position and segment of entries with seg >= 0.

  pos, seg: [b, n*block]. Returns four int32 [n] arrays; a block with no live
  entry gets (INT_MAX, INT_MIN, INT_MAX, INT_MIN) so it never looks needed.
  """
  live = seg >= 0
  def red(x, fill, fn):
    x = jnp.where(live, x, fill).reshape(x.shape[0], -1, block)
    return fn(fn(x, axis=2), axis=0)
  return (red(pos, _INT_MAX, jnp.min), red(pos, _INT_MIN, jnp.max),
          red(seg, _INT_MAX, jnp.min), red(seg, _INT_MIN, jnp.max))


def needed_blocks(q_pos, q_seg, k_pos, k_seg, qb: int, kb: int) -> jax.Array:
  """[nq, nk] bool: key block j may hold an allowed key for query block i.

  Conservative (a superset) from block-level min/max of positions and segment
  ids; the exact mask is applied inside the block. It is the block grid, far
  smaller than N x N.
  """
  _, qpos_max, qseg_min, qseg_max = _block_stats(q_pos, q_seg, qb)
  kpos_min, _, kseg_min, kseg_max = _block_stats(k_pos, k_seg, kb)
  return ((kpos_min[None, :] <= qpos_max[:, None]) & (kseg_min[None, :] <= qseg_max[:, None])
          & (kseg_max[None, :] >= qseg_min[:, None]))


def indexer_scores_dense(q_idx: jax.Array, w_idx: jax.Array, k_idx: jax.Array) -> jax.Array:
  """Lightning-indexer scores of every query against every given key (builds the full matrix).

  Args:
    q_idx: [b, t, h, k] indexer queries.
    w_idx: [b, t, h] per-head weights.
    k_idx: [b, s, k] indexer keys (one per token, shared by the heads).

  Returns:
    [b, t, s] f32 scores, unmasked: sum_h w[b,t,h] relu(q[b,t,h] . k[b,s]).
  """
  # Inputs in q's (compute) dtype, dots kept in f32: they feed top-k and softmax.
  dots = jnp.einsum("bthk,bsk->bths", q_idx, k_idx.astype(q_idx.dtype), preferred_element_type=jnp.float32)
  return jnp.einsum("bths,bth->bts", jax.nn.relu(dots), w_idx.astype(jnp.float32))


def dense_topk(q_idx: jax.Array, w_idx: jax.Array, k_idx: jax.Array, q_pos: jax.Array, q_seg: jax.Array,
               k_pos: jax.Array, k_seg: jax.Array, topk: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Top-k of the dense masked score matrix.

  Returns idx [b, t, topk] int32 (0 where invalid), valid [b, t, topk] bool
  and the dense scores [b, t, s] f32 (-inf where not allowed). topk may
  exceed s (extra slots are invalid).
  """
  scores = jnp.where(allowed_mask(q_pos, q_seg, k_pos, k_seg),
                     indexer_scores_dense(q_idx, w_idx, k_idx), -jnp.inf)
  s = scores.shape[-1]
  if topk > s:
    scores_p = jnp.pad(scores, ((0, 0), (0, 0), (0, topk - s)), constant_values=-jnp.inf)
  else:
    scores_p = scores
  vals, idx = jax.lax.top_k(scores_p, topk)
  valid = vals > -jnp.inf
  return jnp.where(valid, idx, 0).astype(jnp.int32), valid, scores
