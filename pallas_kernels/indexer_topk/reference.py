"""Reference for the indexer top-k kernel: the model's XLA path (plain jnp).

model.attention.sparse.blockwise_topk scores key blocks with the lightning
indexer (DeepSeek-V3.2-Exp, I[t,s] = sum_h w[t,h] relu(q[t,h] . k[s])) and
merges them into a running lax.top_k. `dense_topk` is the plain definition
(the full [b, t, s] score matrix, masked, one lax.top_k): an independent
second reference for the tests, only for small shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.attention.sparse import allowed_mask, blockwise_topk, indexer_scores_dense

__all__ = ["blockwise_topk", "dense_topk"]


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
