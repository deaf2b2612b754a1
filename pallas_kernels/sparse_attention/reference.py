"""Reference for the sparse-attention kernels: the model's XLA path (plain jnp).

model.attention.sparse.sparse_mqa_attention gathers the selected latent rows
one query block at a time and applies a masked f32 softmax (DeepSeek-V3.2-Exp
DSA main attention, absorbed MLA / MQA form). The Pallas kernels in this
package must reproduce it, forward and gradients; `dense_reference` is an
independent second reference (dense attention under the selection mask)
used by the tests to check that the XLA path and the kernels agree with the
plain definition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.attention.sparse import dense_mqa_attention, sparse_mqa_attention

__all__ = ["sparse_mqa_attention", "dense_reference"]


def dense_reference(q_lat: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array,
                    idx: jax.Array, valid: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
  """Sparse MQA as dense MQA under the [b, t, s] mask of the selected keys.

  Only for distinct valid indices per row (a key selected twice counts twice
  in the sparse form, once here). Returns out_lat [b, t, h, c] and p_sel
  [b, t, j] (the dense head-summed probabilities read back at idx).
  """
  b, t, _ = idx.shape
  s = latent.shape[1]
  ix = jnp.clip(idx, 0, s - 1)
  rows = (jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], ix)
  mask = jnp.zeros((b, t, s), bool).at[rows].max(valid.astype(bool))
  out, p = dense_mqa_attention(q_lat, q_rope, latent, k_rope, mask, scale)
  return out, jnp.where(valid, jnp.take_along_axis(p, ix, axis=-1), 0.0)
