"""Memory-efficient dense causal MQA over the MLA latent: the baseline DSA is measured against.

Flash-style attention (Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient
Exact Attention with IO-Awareness"; the online softmax of Milakov & Gimelshein
2018) in plain JAX: queries are processed in blocks, each block scans the key
blocks at or before it with a running max / sum / accumulator, and the
backward pass recomputes each tile's probabilities from the saved
log-sum-exp. Nothing of size N x N exists in either pass: memory is
O(query_block * key_block * heads) beyond the inputs and outputs, and the
causal trip count skips key blocks wholly in a query block's future, so the
work is the N^2/2 causal pairs.

The attention is MLA's absorbed form (DeepSeek-V2, Liu et al. 2024, sec. 2.1),
the same maths as the DSA layer's main attention with every causal key
selected: logit = scale * (q_lat . latent + q_rope . k_rope), out = P latent.
All heads share the one latent + RoPE key per token (MQA), so a tile's logits
are one [query_block * heads, c+p] x [c+p, key_block] matmul. The plain
definition is `dense_mqa_attention` under a causal mask
(pallas_kernels/sparse_attention/reference.py); tests/test_flash.py checks
outputs and gradients against it.

Einsum legend: b batch, t query, s key, h heads, d = c + p (latent + RoPE dims),
c latent (kv_lora) dim.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from model.config import is_int
from model.layers import einsum_f32
from pallas_kernels.common import need, pad_axis1
from pallas_kernels.sparse_attention.reference import check_mqa_args, dense_mqa_attention

_NEG_INF = float("-inf")


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static block layout (hashable, a custom_vjp static argument): t queries in blocks of qb
  (padded to tp), keys in blocks of kb, c latent dims, softmax scale."""

  t: int
  qb: int
  kb: int
  c: int
  scale: float

  @property
  def tp(self) -> int:
    return _cdiv(self.t, self.qb) * self.qb

  def key_blocks(self, i):
    """Key blocks that hold a key at or before query block i's last query."""
    return jnp.minimum(((i + 1) * self.qb - 1) // self.kb + 1, _cdiv(self.t, self.kb))

  def tile(self, qi, kv, i, j):
    """Scaled f32 logits [b, qb, h, kb] of query block i against key block j, causal mask, keys."""
    kj = jax.lax.dynamic_slice_in_dim(kv, j * self.kb, self.kb, axis=1)
    logits = einsum_f32("bthd,bsd->bths", qi, kj) * self.scale
    q_ix = i * self.qb + jnp.arange(self.qb)
    k_ix = j * self.kb + jnp.arange(self.kb)
    mask = (k_ix[None, :] <= q_ix[:, None]) & (k_ix[None, :] < self.t)
    return logits, mask[None, :, None, :], kj


def _fwd(plan: _Plan, q, kv):
  """out [b, tp, h, c] in q's dtype and lse [b, tp, h] f32."""
  b, _, h, _ = q.shape
  dtype, qb, c = q.dtype, plan.qb, plan.c

  def query_block(i):
    qi = jax.lax.dynamic_slice_in_dim(q, i * qb, qb, axis=1)

    def step(j, carry):
      m, den, acc = carry
      logits, mask, kj = plan.tile(qi, kv, i, j)
      m_new = jnp.maximum(m, jnp.max(jnp.where(mask, logits, _NEG_INF), axis=-1))
      e = jnp.where(mask, jnp.exp(logits - m_new[..., None]), 0.0)
      alpha = jnp.exp(m - m_new)
      acc = acc * alpha[..., None] + einsum_f32("bths,bsc->bthc", e.astype(dtype), kj[..., :c])
      return m_new, den * alpha + jnp.sum(e, axis=-1), acc

    # Key 0 precedes every query, so after the first tile each row's max is finite.
    init = (jnp.full((b, qb, h), _NEG_INF, jnp.float32), jnp.zeros((b, qb, h), jnp.float32),
            jnp.zeros((b, qb, h, c), jnp.float32))
    m, den, acc = jax.lax.fori_loop(0, plan.key_blocks(i), step, init)
    return (acc / den[..., None]).astype(dtype), m + jnp.log(den)

  out, lse = jax.lax.map(query_block, jnp.arange(plan.tp // qb))
  return (jnp.moveaxis(out, 0, 1).reshape((b, plan.tp, h, c)),
          jnp.moveaxis(lse, 0, 1).reshape((b, plan.tp, h)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan: _Plan, q, kv):
  return _fwd(plan, q, kv)[0]


def _flash_fwd(plan, q, kv):
  out, lse = _fwd(plan, q, kv)
  return out, (q, kv, out, lse)


def _flash_bwd(plan, res, d_out):
  """Per query block: dq from its key tiles; dK/dV tiles are added into a carried d[latent|k_rope]."""
  q, kv, out, lse = res
  dtype, qb, kb, c = q.dtype, plan.qb, plan.kb, plan.c
  d_out = d_out.astype(dtype)
  rowsum = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [b, tp, h]

  def query_block(dkv, i):
    sl = lambda x: jax.lax.dynamic_slice_in_dim(x, i * qb, qb, axis=1)  # noqa: E731
    qi, do, ls, rs = sl(q), sl(d_out), sl(lse), sl(rowsum)

    def step(j, carry):
      dq, dkv = carry
      logits, mask, kj = plan.tile(qi, kv, i, j)
      p = jnp.where(mask, jnp.exp(logits - ls[..., None]), 0.0)
      dp = einsum_f32("bthc,bsc->bths", do, kj[..., :c])
      ds = (p * (dp - rs[..., None]) * plan.scale).astype(dtype)
      dq = dq + einsum_f32("bths,bsd->bthd", ds, kj)
      dk = einsum_f32("bths,bthd->bsd", ds, qi)
      dv = einsum_f32("bths,bthc->bsc", p.astype(dtype), do)
      dk = dk + jnp.pad(dv, ((0, 0), (0, 0), (0, dk.shape[-1] - c)))
      prev = jax.lax.dynamic_slice_in_dim(dkv, j * kb, kb, axis=1)
      return dq, jax.lax.dynamic_update_slice_in_dim(dkv, prev + dk, j * kb, axis=1)

    dq, dkv = jax.lax.fori_loop(0, plan.key_blocks(i), step, (jnp.zeros(qi.shape, jnp.float32), dkv))
    return dkv, dq.astype(dtype)

  dkv, dq = jax.lax.scan(query_block, jnp.zeros(kv.shape, jnp.float32), jnp.arange(plan.tp // qb))
  dq = jnp.moveaxis(dq, 0, 1).reshape(q.shape)
  return dq, dkv.astype(kv.dtype)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_mqa_attention(q_lat: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array,
                        scale: float, query_block: int, key_block: int) -> jax.Array:
  """Causal MQA over the MLA latent, blockwise with an online softmax (see the module docstring).

  Queries and keys are the same sequence: query t attends to keys 0..t.

  Args:
    q_lat: [b, t, h, c] absorbed queries (q_nope W_uk).
    q_rope: [b, t, h, p] RoPE'd query part.
    latent: [b, t, c] per-token latent.
    k_rope: [b, t, p] per-token RoPE key, shared by all heads.
    scale: softmax scale.
    query_block, key_block: block sizes (capped at t; t is padded internally).

  Returns:
    out_lat [b, t, h, c] in q_lat's dtype (softmax in f32, matmuls in q_lat's
    dtype with f32 accumulation).
  """
  b, t, _, s = check_mqa_args("flash_mqa_attention", q_lat, q_rope, latent, k_rope)
  need(s == t, f"flash_mqa_attention: causal self-attention needs as many keys as queries, got "
       f"latent with {s} keys for {t} queries.")
  need(t > 0, f"flash_mqa_attention: t={t}: needs at least one query.")
  for name, val in (("query_block", query_block), ("key_block", key_block)):
    need(is_int(val, numpy=True) and val > 0, f"flash_mqa_attention: {name}={val!r} must be a positive int.")
  dtype, c = q_lat.dtype, q_lat.shape[3]
  plan = _Plan(t, min(int(query_block), t), min(int(key_block), t), c, float(scale))
  sp = _cdiv(t, plan.kb) * plan.kb
  q = pad_axis1(jnp.concatenate([q_lat, q_rope.astype(dtype)], axis=-1), plan.tp, 0)
  kv = pad_axis1(jnp.concatenate([latent.astype(dtype), k_rope.astype(dtype)], axis=-1), sp, 0)
  return _flash(plan, q, kv)[:, :t]


def causal_reference(q_lat, q_rope, latent, k_rope, scale: float) -> jax.Array:
  """The plain definition: dense MQA under the [b, t, t] causal mask (small shapes only)."""
  b, t = q_lat.shape[:2]
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  return dense_mqa_attention(q_lat, q_rope, latent, k_rope, mask, scale)[0]
