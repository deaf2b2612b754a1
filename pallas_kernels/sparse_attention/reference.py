"""The sparse MQA kernels' contract: argument checks and plain maths (DSA main attention).

DeepSeek Sparse Attention (DeepSeek-AI, "DeepSeek-V3.2-Exp: Boosting
Long-Context Efficiency with DeepSeek Sparse Attention", 2025) attends from
each query to its selected keys only. The attention is MQA over the MLA
latent in absorbed form (DeepSeek-V2, Liu et al. 2024, sec. 2.1): one latent
and one RoPE key per token, shared by all heads.

Two fast paths compute it over the selected rows: the Pallas kernels (ops.py)
and the model's query-blocked gather (model/attention/sparse.py:
sparse_mqa_attention). This module is what both must equal and what they
share:

* `check_mqa_args`: the shape checks of their common signature.
* `masked_softmax` and `head_summed`: the f32 softmax over the allowed keys
  and the head-summed distribution p_sel that feeds the indexer's KL loss.
* `dense_mqa_attention`: the plain definition, dense attention under an
  explicit [b, t, s] mask (also the model's dense warm-up stage), and
  `dense_reference`, the sparse form written as dense attention under the
  mask of the selected keys (small shapes only).

Only jax: importing this module loads no Pallas.

Einsum legend: b batch, t query, s key, h heads, c latent (kv_lora) dim,
p RoPE dim, j selected top-k slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import need

_NEG_INF = float("-inf")


def check_mqa_args(fn: str, q_lat, q_rope, latent, k_rope) -> tuple[int, int, int, int]:
  """Raises a ValueError naming the argument unless the shapes fit; returns (b, t, h, s).

  Args:
    fn: the caller's name, for the message.
    q_lat: [b, t, h, c]; q_rope: [b, t, h, p]; latent: [b, s, c]; k_rope: [b, s, p].
  """
  need(q_lat.ndim == 4, f"{fn}: q_lat must be [b, t, heads, latent], got shape {q_lat.shape}.")
  b, t, h, c = q_lat.shape
  need(q_rope.ndim == 4 and q_rope.shape[:3] == (b, t, h),
       f"{fn}: q_rope must be [b={b}, t={t}, heads={h}, rope], got {q_rope.shape}.")
  need(latent.ndim == 3 and latent.shape[0] == b and latent.shape[2] == c,
       f"{fn}: latent must be [b={b}, s, latent={c}], got {latent.shape}.")
  s = latent.shape[1]
  need(k_rope.shape == (b, s, q_rope.shape[3]),
       f"{fn}: k_rope must be [b, s, rope]={(b, s, q_rope.shape[3])}, got {k_rope.shape}.")
  return b, t, h, s


def masked_softmax(logits: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax over the last axis restricted to `mask`, in f32.

  A row with no allowed entry gives all zeros (not NaN). Masked entries are
  replaced before exp, so their gradient is exactly zero, never inf * 0.
  """
  logits = logits.astype(jnp.float32)
  m = jnp.max(jnp.where(mask, logits, _NEG_INF), axis=-1, keepdims=True)
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  e = jnp.where(mask, jnp.exp(jnp.where(mask, logits, m) - m), 0.0)
  den = jnp.sum(e, axis=-1, keepdims=True)
  return e / jnp.where(den > 0, den, 1.0)


def head_summed(p: jax.Array) -> jax.Array:
  """[b, t, h, n] probabilities -> [b, t, n] summed over heads, L1-normalised (0 rows stay 0)."""
  ps = jnp.sum(p, axis=2)
  tot = jnp.sum(ps, axis=-1, keepdims=True)
  return ps / jnp.where(tot > 0, tot, 1.0)


def _logits_f32(spec: str, q: jax.Array, k: jax.Array) -> jax.Array:
  """einsum with inputs in q's (compute) dtype and the f32 result kept (it feeds the softmax)."""
  return jnp.einsum(spec, q, k.astype(q.dtype), preferred_element_type=jnp.float32)


def dense_mqa_attention(q_lat: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array,
                        mask: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
  """Dense MQA over the latent with an explicit [b, t, s] mask.

  Args:
    q_lat: [b, t, h, c]; q_rope: [b, t, h, p]; latent: [b, s, c]; k_rope: [b, s, p].
    mask: [b, t, s] bool.
    scale: softmax scale.

  Returns:
    out_lat [b, t, h, c] in q_lat's dtype and p [b, t, s] f32 head-summed,
    L1-normalised probabilities.
  """
  b, t, _, s = check_mqa_args("dense_mqa_attention", q_lat, q_rope, latent, k_rope)
  need(mask.shape == (b, t, s), f"dense_mqa_attention: mask must be [b, t, s]={(b, t, s)}, "
       f"got {mask.shape}.")
  logits = (_logits_f32("bthc,bsc->bths", q_lat, latent)
            + _logits_f32("bthp,bsp->bths", q_rope, k_rope)) * scale
  p = masked_softmax(logits, mask[:, :, None, :])
  dtype = q_lat.dtype
  out = jnp.einsum("bths,bsc->bthc", p.astype(dtype), latent.astype(dtype),
                   preferred_element_type=jnp.float32).astype(dtype)
  return out, head_summed(p)


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
