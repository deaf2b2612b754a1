"""Gather-based sparse attention primitives for Gated DSA.

DeepSeek Sparse Attention (DeepSeek-AI, "DeepSeek-V3.2-Exp: Boosting Long-Context
Efficiency with DeepSeek Sparse Attention", 2025) lets each query attend to the
`topk` keys chosen by a cheap "lightning indexer", I[t,s] = sum_h w[t,h] *
relu(q[t,h] . k[s]), so the main attention costs O(N*k) instead of O(N^2).
Public JAX code builds the full N x N indexer matrix and an N x N mask and then
runs dense attention; that is still quadratic in memory. Here nothing of size
N x N exists:

* `blockwise_topk` scores keys block by block and keeps a running top-k per
  query (merged with `lax.top_k`), so its peak memory is O(N*k) plus one
  query_block x key_block x heads score tile;
  key blocks that lie entirely in a query block's causal future (or hold no
  key of the query block's segments) are skipped with a dynamic trip count.
* `sparse_mqa_attention` gathers only the selected rows of [latent | k_rope],
  one query block at a time, so neither the forward nor the backward pass
  holds more than one block's gathered query_block x k x (c+p) slab. All heads
  of a query share its key set (MQA over the latent), so each query's logits
  are one [heads, c+p] x [c+p, k] product. A custom VJP saves only the output
  and the log-sum-exp per (query, head) and recomputes each block's
  probabilities in the backward pass (flash-style), which then scatter-adds
  the selected rows' gradients.

The attention is MQA over the MLA latent in absorbed form (DeepSeek-V2, Liu et
al. 2024, sec. 2.1): one latent + one RoPE key per token is all that is read
and all that a decode cache stores.

The plain definitions both paths must equal, their argument checks and the
block-skip plan live with the Pallas kernels that compute the same functions
(pallas_kernels/indexer_topk/reference.py, pallas_kernels/sparse_attention/
reference.py); this module imports them. The dense ones (`allowed_mask`,
`indexer_scores_dense`, `dense_mqa_attention`) also serve the indexer's dense
warm-up stage (model/attention/dsa.py).

Einsum legend: b batch, t query, s key, h heads (main or indexer), k indexer
head dim, c latent (kv_lora) dim, p RoPE dim, j selected top-k slot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from model.config import is_int
from model.layers import F32_SCOPE, einsum, einsum_f32
from pallas_kernels.common import need, pad_axis1
from pallas_kernels.indexer_topk.reference import (
    allowed_mask,
    check_topk_args,
    indexer_scores_dense,
    needed_blocks,
)
from pallas_kernels.sparse_attention.reference import check_mqa_args, head_summed

_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------
# Block layout helpers and the indexer's KL loss.
# ---------------------------------------------------------------------------
def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _to_blocks(x: jax.Array, block: int) -> jax.Array:
  """[b, n*block, ...] -> [n, b, block, ...] (block index leading, for lax.map)."""
  b, n = x.shape[0], x.shape[1] // block
  return jnp.moveaxis(x.reshape((b, n, block) + x.shape[2:]), 1, 0)


def _from_blocks(x: jax.Array) -> jax.Array:
  """[n, b, block, ...] -> [b, n*block, ...]."""
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])


def _gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x [b, s, ...], idx [b, t, j] -> x[b, idx] [b, t, j, ...]."""
  return jax.vmap(lambda xb, ib: jnp.take(xb, ib, axis=0, mode="clip"))(x, idx)


def masked_log_softmax(logits: jax.Array, mask: jax.Array) -> jax.Array:
  """log-softmax over the last axis restricted to `mask` (f32); 0 where masked."""
  logits = logits.astype(jnp.float32)
  m = jnp.max(jnp.where(mask, logits, _NEG_INF), axis=-1, keepdims=True)
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  shifted = jnp.where(mask, logits, m) - m
  den = jnp.sum(jnp.where(mask, jnp.exp(shifted), 0.0), axis=-1, keepdims=True)
  return jnp.where(mask, shifted - jnp.log(jnp.where(den > 0, den, 1.0)), 0.0)


def indexer_kl(p_target: jax.Array, logits: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean over query rows of KL(p_target || softmax_mask(logits)).

  The indexer's training signal (DeepSeek-V3.2-Exp sec. 2.1): the head-summed,
  L1-normalised main-attention distribution is the target, and it is
  stop_gradient'ed so the indexer loss never moves the main model. Rows with
  no allowed entry (padding) are left out of the mean.

  Args:
    p_target: [b, t, n] target distribution (rows sum to 1 over `mask`).
    logits: [b, t, n] indexer scores.
    mask: [b, t, n] bool, entries that take part.

  Returns:
    f32 scalar.
  """
  p = jax.lax.stop_gradient(p_target.astype(jnp.float32))
  logq = masked_log_softmax(logits, mask)
  keep = mask & (p > 0)
  logp = jnp.log(jnp.where(keep, p, 1.0))
  kl_row = jnp.sum(jnp.where(keep, p * (logp - logq), 0.0), axis=-1)
  rows = jnp.any(mask, axis=-1)
  return jnp.sum(jnp.where(rows, kl_row, 0.0)) / jnp.maximum(jnp.sum(rows), 1)


# ---------------------------------------------------------------------------
# Indexer: blockwise top-k, the selected keys' scores, and top-k as a mask.
# ---------------------------------------------------------------------------
def _ordered_key(x: jax.Array) -> jax.Array:
  """int32 keys in the order of the float32 values (total order: -0.0 < +0.0)."""
  i = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)


def topk_mask(scores: jax.Array, allowed: jax.Array, topk: int) -> jax.Array:
  """[..., s] bool: the `topk` allowed entries of each row with the largest scores.

  The set lax.top_k selects from where(allowed, scores, -inf) (ties: lower position first;
  a row with at most topk allowed entries keeps them all), found without sorting: the k-th
  largest score of each row by bisection over the scores' int32 order keys (32 counting
  passes over the row), then, among entries equal to it, the lowest positions by bisection
  over the position (log2 s passes). On XLA:CPU this is ~4x faster than lax.top_k plus a
  scatter into a mask for 8 x 1024 rows of 1024 ([8, 1024, 1024], k = 512: 149 vs 595 ms).
  No gradient flows through the selection.

  Args:
    scores: [..., s] float scores (f32 order; NaN is not allowed).
    allowed: [..., s] bool, the entries that may be selected.
    topk: entries kept per row (>= 1).

  Returns:
    [..., s] bool mask, a subset of `allowed` with min(topk, allowed per row) entries per row.
  """
  need(is_int(topk, numpy=True) and topk >= 1,
       f"topk_mask: topk={topk!r} must be an int >= 1.")  # True would keep one entry per row
  topk = int(topk)
  need(scores.shape == allowed.shape, f"topk_mask: scores {scores.shape} and allowed {allowed.shape} "
       "must have the same shape.")
  key = _ordered_key(jax.lax.stop_gradient(scores))
  n_allowed = jnp.sum(allowed, axis=-1, dtype=jnp.int32)

  def count(sel: jax.Array) -> jax.Array:
    return jnp.sum(sel, axis=-1, dtype=jnp.int32)

  # The largest T with count(key >= T) >= topk (rows with more than topk allowed entries; the
  # others keep `allowed` below). Invariant: count(lo) >= topk; ceil((lo + hi) / 2) without
  # int32 overflow.
  def value_step(_, bounds):
    lo, hi = bounds
    mid = (lo >> 1) + (hi >> 1) + ((lo | hi) & 1)
    ok = count(allowed & (key >= mid[..., None])) >= topk
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

  i32 = jnp.iinfo(jnp.int32)
  init = (jnp.full(n_allowed.shape, i32.min, jnp.int32), jnp.full(n_allowed.shape, i32.max, jnp.int32))
  kth, _ = jax.lax.fori_loop(0, 32, value_step, init)
  above = allowed & (key > kth[..., None])
  tied = allowed & (key == kth[..., None])
  short = topk - count(above)  # >= 1 where a row has more than topk allowed entries
  pos = jnp.arange(scores.shape[-1], dtype=jnp.int32)

  # The smallest position P with count(tied & pos <= P) >= short.
  def pos_step(_, bounds):
    lo, hi = bounds
    mid = (lo + hi) >> 1
    ok = count(tied & (pos <= mid[..., None])) >= short
    return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

  last = jnp.full(n_allowed.shape, scores.shape[-1] - 1, jnp.int32)
  steps = max(1, (scores.shape[-1] - 1).bit_length())
  cut, _ = jax.lax.fori_loop(0, steps, pos_step, (jnp.zeros_like(last), last))
  selected = above | (tied & (pos <= cut[..., None]))
  return jnp.where((n_allowed <= topk)[..., None], allowed, selected)


def _topk_query_block(q, w, qp, qs, k_idx, k_pos, k_seg, needed, topk: int, kb: int):
  """Running top-k over the needed key blocks for one query block.

  q [b,qb,h,k], w [b,qb,h], qp/qs [b,qb]; k_idx [b,S,k], k_pos/k_seg [b,S]
  (S a multiple of kb); needed [nk] bool. Returns vals [b,qb,topk] f32 and
  idx [b,qb,topk] int32.
  """
  b, qb = qp.shape
  nk = needed.shape[0]
  any_needed = jnp.any(needed)
  lo = jnp.where(any_needed, jnp.argmax(needed), 0)
  hi = jnp.where(any_needed, nk - jnp.argmax(needed[::-1]), 0)

  def merge(j, carry):
    vals, idx = carry
    start = j * kb
    kk = jax.lax.dynamic_slice_in_dim(k_idx, start, kb, axis=1)
    kp = jax.lax.dynamic_slice_in_dim(k_pos, start, kb, axis=1)
    ks = jax.lax.dynamic_slice_in_dim(k_seg, start, kb, axis=1)
    with jax.named_scope(F32_SCOPE):  # the head-weighted sum of f32 dots feeds top-k
      scores = jnp.where(allowed_mask(qp, qs, kp, ks), indexer_scores_dense(q, w, kk), _NEG_INF)
    ids = jnp.broadcast_to(start + jnp.arange(kb, dtype=jnp.int32), (b, qb, kb))
    vals, pick = jax.lax.top_k(jnp.concatenate([vals, scores], axis=-1), topk)
    idx = jnp.take_along_axis(jnp.concatenate([idx, ids], axis=-1), pick, axis=-1)
    return vals, idx

  def body(j, carry):
    return jax.lax.cond(needed[j], merge, lambda _, c: c, j, carry)

  init = (jnp.full((b, qb, topk), _NEG_INF, jnp.float32), jnp.zeros((b, qb, topk), jnp.int32))
  return jax.lax.fori_loop(lo, hi, body, init)


def blockwise_topk(q_idx: jax.Array, w_idx: jax.Array, k_idx: jax.Array, q_pos: jax.Array,
                   q_seg: jax.Array, k_pos: jax.Array, k_seg: jax.Array, topk: int,
                   query_block: int, key_block: int) -> tuple[jax.Array, jax.Array]:
  """Top-k keys per query under the lightning-indexer score, without an N x N matrix.

  Key s is allowed for query t iff k_seg[s] == q_seg[t], k_seg[s] >= 0 and
  k_pos[s] <= q_pos[t] (so negative k_seg marks unfilled cache slots). For
  each query block, key blocks are scored in turn and merged into a running
  top-k with `lax.top_k`; key blocks that cannot hold an allowed key are
  skipped. No gradient flows through the selection. Ties: lax.top_k's
  (lower position first) order.

  Args:
    q_idx: [b, t, h, k] indexer queries.
    w_idx: [b, t, h] indexer head weights.
    k_idx: [b, s, k] indexer keys.
    q_pos, q_seg: [b, t] int query positions and segment ids.
    k_pos, k_seg: [b, s] int key positions and segment ids.
    topk: slots per query (may exceed the number of allowed keys).
    query_block, key_block: block sizes (capped at t and s; t and s are padded
      to block multiples internally).

  Returns:
    idx [b, t, topk] int32 key indices (0 where invalid) and valid
    [b, t, topk] bool (False for slots beyond the allowed keys).
  """
  check_topk_args(q_idx, w_idx, k_idx, q_pos, q_seg, k_pos, k_seg, topk, query_block, key_block)
  t, s = q_idx.shape[1], k_idx.shape[1]
  qb, kb = min(query_block, t), min(key_block, s)
  tp, sp = _cdiv(t, qb) * qb, _cdiv(s, kb) * kb
  sg = jax.lax.stop_gradient
  q_idx, w_idx = pad_axis1(sg(q_idx), tp, 0), pad_axis1(sg(w_idx), tp, 0)
  q_pos, q_seg = pad_axis1(q_pos.astype(jnp.int32), tp, 0), pad_axis1(q_seg.astype(jnp.int32), tp, -1)
  k_idx = pad_axis1(sg(k_idx), sp, 0)
  k_pos, k_seg = pad_axis1(k_pos.astype(jnp.int32), sp, 0), pad_axis1(k_seg.astype(jnp.int32), sp, -1)
  needed = needed_blocks(q_pos, q_seg, k_pos, k_seg, qb, kb)

  def one_block(args):
    q, w, qp, qs, nd = args
    return _topk_query_block(q, w, qp, qs, k_idx, k_pos, k_seg, nd, topk, kb)

  blocks = (_to_blocks(q_idx, qb), _to_blocks(w_idx, qb), _to_blocks(q_pos, qb),
            _to_blocks(q_seg, qb), needed)
  vals, idx = jax.lax.map(one_block, blocks)
  vals, idx = _from_blocks(vals)[:, :t], _from_blocks(idx)[:, :t]
  valid = vals > _NEG_INF
  return jnp.where(valid, idx, 0), valid


def selected_indexer_scores(q_idx: jax.Array, w_idx: jax.Array, k_idx: jax.Array, idx: jax.Array,
                            query_block: int) -> jax.Array:
  """Indexer scores of the selected keys only, differentiable (for the sparse-stage loss).

  Query-blocked under jax.checkpoint so no [t, topk, k] slab of gathered keys
  lives at once, in the forward or the backward pass.

  Args:
    q_idx: [b, t, h, k]; w_idx: [b, t, h]; k_idx: [b, s, k].
    idx: [b, t, j] selected key indices (in [0, s)).
    query_block: queries per block (capped at t).

  Returns:
    [b, t, j] f32 scores I[t, idx[t, j]].
  """
  b, t, h, k = q_idx.shape
  need(w_idx.shape == (b, t, h) and k_idx.ndim == 3 and k_idx.shape[2] == k and idx.shape[:2] == (b, t),
       f"selected_indexer_scores: shapes q_idx {q_idx.shape}, w_idx {w_idx.shape}, "
       f"k_idx {k_idx.shape}, idx {idx.shape} do not match [b,t,h,k], [b,t,h], [b,s,k], [b,t,j].")
  qb = min(query_block, t)
  tp = _cdiv(t, qb) * qb

  def body(args):
    q, w, ix = args
    dots = einsum_f32("bthk,btjk->bthj", q, _gather_rows(k_idx, ix))
    with jax.named_scope(F32_SCOPE):  # the head-weighted sum of f32 dots feeds the indexer's KL
      return jnp.einsum("bthj,bth->btj", jax.nn.relu(dots), w.astype(jnp.float32))

  blocks = (_to_blocks(pad_axis1(q_idx, tp, 0), qb), _to_blocks(pad_axis1(w_idx, tp, 0), qb),
            _to_blocks(pad_axis1(idx, tp, 0), qb))
  out = jax.lax.map(jax.checkpoint(body, prevent_cse=False), blocks)
  return _from_blocks(out)[:, :t]


# ---------------------------------------------------------------------------
# Main attention: sparse MQA over the MLA latent (custom VJP, flash-style backward).
# ---------------------------------------------------------------------------
def _block_logits(q: jax.Array, g: jax.Array, vd: jax.Array, scale: float):
  """q [b,qb,h,d], g [b,qb,j,d] gathered keys, vd [b,qb,j] -> scaled f32 logits [b,qb,h,j], mask."""
  return einsum_f32("bthd,btjd->bthj", q, g) * scale, vd[:, :, None, :]


def _sparse_fwd_blocks(q, kv, idx, valid, scale: float, c: int, qb: int):
  """Forward over query blocks: out [b,tp,h,c], lse [b,tp,h] f32, p_sel [b,tp,j] f32.

  Each query block gathers its selected rows of kv = [latent | k_rope] once
  ([b, qb, j, c+p]); per query, all h heads share that key set, so the logits
  are one [h, c+p] x [c+p, j] product and the output one [h, j] x [j, c].
  """
  dtype = q.dtype

  def body(args):
    qi, ix, vd = args
    g = _gather_rows(kv, ix)
    logits, mask = _block_logits(qi, g, vd, scale)
    m = jnp.max(jnp.where(mask, logits, _NEG_INF), axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(mask, jnp.exp(jnp.where(mask, logits, m) - m), 0.0)
    den = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(den > 0, den, 1.0)
    out = einsum("bthj,btjc->bthc", p, g[..., :c], dtype)
    lse = (m + jnp.log(jnp.where(den > 0, den, 1.0)))[..., 0]
    return out, lse, head_summed(p)

  out, lse, p_sel = jax.lax.map(body, (_to_blocks(q, qb), _to_blocks(idx, qb), _to_blocks(valid, qb)))
  return _from_blocks(out), _from_blocks(lse), _from_blocks(p_sel)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _sparse_core(q, kv, idx, valid, scale: float, c: int, qb: int):
  """(out [b,tp,h,c], p_sel [b,tp,j]) for q [b,tp,h,d] (tp a multiple of qb), kv [b,s,d]."""
  out, _, p_sel = _sparse_fwd_blocks(q, kv, idx, valid, scale, c, qb)
  return out, p_sel


def _sparse_core_fwd(q, kv, idx, valid, scale, c, qb):
  out, lse, p_sel = _sparse_fwd_blocks(q, kv, idx, valid, scale, c, qb)
  return (out, p_sel), (q, kv, idx, valid, lse)


def _sparse_core_bwd(scale, c, qb, res, cts):
  """Recomputes each block's probabilities from the saved log-sum-exp (nothing [t, h, j] is kept).

  With P the softmax and dP = dO V^T + dp_sel / h (p_sel = sum_h P / h on rows
  with a valid slot), dS = P * (dP - rowsum(P * dP)); dq = dS K, and the
  selected rows receive dS^T q and P^T dO, scatter-added into d[latent | k_rope].
  """
  q, kv, idx, valid, lse = res
  d_out, d_psel = cts
  dtype, h = q.dtype, q.shape[2]

  def step(dkv, args):
    qi, ix, vd, do, ls, dps = args
    g = _gather_rows(kv, ix)
    logits, mask = _block_logits(qi, g, vd, scale)
    p = jnp.where(mask, jnp.exp(logits - ls[..., None]), 0.0)
    dp = einsum_f32("bthc,btjc->bthj", do.astype(dtype), g[..., :c]) + dps[:, :, None, :] / h
    ds = p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True)) * scale
    dq = einsum("bthj,btjd->bthd", ds, g, dtype)
    dg = einsum_f32("bthj,bthd->btjd", ds.astype(dtype), qi)
    dg = dg + jnp.pad(einsum_f32("bthj,bthc->btjc", p.astype(dtype), do.astype(dtype)),
                      ((0, 0), (0, 0), (0, 0), (0, dg.shape[-1] - c)))
    rows = jnp.arange(ix.shape[0])[:, None, None]
    return dkv.at[rows, ix].add(dg, mode="drop"), dq

  blocks = tuple(_to_blocks(a, qb) for a in (q, idx, valid, d_out, lse, d_psel))
  dkv, dq = jax.lax.scan(step, jnp.zeros(kv.shape, jnp.float32), blocks)
  return _from_blocks(dq), dkv.astype(kv.dtype), None, None


_sparse_core.defvjp(_sparse_core_fwd, _sparse_core_bwd)


def sparse_mqa_attention(q_lat: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array,
                         idx: jax.Array, valid: jax.Array, scale: float,
                         query_block: int) -> tuple[jax.Array, jax.Array]:
  """MQA over the selected latent rows (absorbed MLA), query block by query block.

  logit[t,h,j] = scale * (q_lat[t,h] . latent[idx[t,j]] + q_rope[t,h] . k_rope[idx[t,j]]),
  softmax over the valid slots in f32, out[t,h] = sum_j p * latent[idx[t,j]].
  A custom VJP keeps only the output and the per-(query, head) log-sum-exp:
  the backward pass re-gathers each block's rows, recomputes its probabilities
  and scatter-adds the key gradients, so memory is O(query_block * topk)
  beyond the inputs, and no gradient is taken through the gather's clipping
  or the softmax's masking.

  Args:
    q_lat: [b, t, h, c] absorbed queries (q_nope W_uk).
    q_rope: [b, t, h, p] RoPE'd query part.
    latent: [b, s, c] per-token latent (the cached MLA state).
    k_rope: [b, s, p] per-token RoPE key, shared by all heads.
    idx: [b, t, j] selected key indices; valid: [b, t, j] bool.
    scale: softmax scale.
    query_block: queries per block (capped at t).

  Returns:
    out_lat [b, t, h, c] in q_lat's dtype (zero for a row with no valid slot)
    and p_sel [b, t, j] f32, the head-summed probabilities normalised to sum 1
    (differentiable too).
  """
  b, t, _, _ = check_mqa_args("sparse_mqa_attention", q_lat, q_rope, latent, k_rope)
  c = q_lat.shape[3]
  need(idx.ndim == 3 and idx.shape[:2] == (b, t) and valid.shape == idx.shape,
       f"sparse_mqa_attention: idx and valid must both be [b={b}, t={t}, topk], "
       f"got {idx.shape} and {valid.shape}.")
  need(isinstance(query_block, int) and query_block > 0,
       f"sparse_mqa_attention: query_block={query_block!r} must be a positive int.")
  dtype = q_lat.dtype
  qb = min(query_block, t)
  tp = _cdiv(t, qb) * qb
  q = jnp.concatenate([q_lat, q_rope.astype(dtype)], axis=-1)
  kv = jnp.concatenate([latent.astype(dtype), k_rope.astype(dtype)], axis=-1)
  s = kv.shape[1]
  ix = jnp.clip(pad_axis1(idx.astype(jnp.int32), tp, 0), 0, s - 1)
  out, p_sel = _sparse_core(pad_axis1(q, tp, 0), kv, ix, pad_axis1(valid.astype(bool), tp, False),
                            float(scale), c, qb)
  return out[:, :t], p_sel[:, :t]
