"""Gated DSA: MLA + lightning indexer + top-k sparse attention + sigmoid output gate.

* MLA (DeepSeek-V2, Liu et al. 2024; DeepSeek-V3 2024): queries and keys go
  through low-rank bottlenecks; the per-token KV state is one normalised
  latent (kv_lora_rank) plus one RoPE key shared by all heads. With W_uk
  absorbed into the query (q_lat = q_nope W_uk) attention is MQA over that
  latent, so the latent + RoPE key is all a decode cache holds.
* DeepSeek Sparse Attention (DeepSeek-V3.2-Exp, 2025): a lightning indexer,
  I[t,s] = sum_j w[t,j] relu(q_I[t,j] . k_I[s]), picks the top-k keys per
  query and the main attention reads only those, O(N*k) instead of O(N^2).
  The indexer is detached from the main model (its inputs are
  stop_gradient'ed) and learns only from a KL loss towards the main
  attention's head-summed distribution: dense over all allowed keys in the
  warm-up stage, over the selected keys in the sparse stage.
* Gated attention (Qiu et al. 2025, "Gated Attention for Large Language
  Models"): o <- o * sigmoid(x W_g) per head and channel before W_o; it adds
  a data-dependent non-linearity after the low-rank value path and removes
  attention sinks.

Einsum legend: b batch, t query, s key, d model, h heads (main or indexer),
k head dim, v value dim, r q_lora rank, c latent (kv_lora) dim.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from model.attention import sparse
from model.config import ModelConfig
from model.layers import F32_SCOPE, RMSNorm, apply_rope, check_prefix_mask, einsum, param, scatter_set
from pallas_kernels.indexer_topk.reference import allowed_mask, indexer_scores_dense
from pallas_kernels.sparse_attention.reference import dense_mqa_attention
from sharding.rules import per_shard


def _kernels(use_pallas: bool):
  """(top-k selection, sparse MQA): the Pallas kernels or the XLA paths of `sparse`."""
  if not use_pallas:
    return sparse.blockwise_topk, sparse.sparse_mqa_attention
  from pallas_kernels.indexer_topk import ops as topk_ops  # noqa: PLC0415 - optional backend
  from pallas_kernels.sparse_attention import ops as attn_ops  # noqa: PLC0415

  # Under a mesh each device runs the kernels on its own batch rows
  # (sharding.rules.per_shard); heads stay whole because p_sel sums over them.
  def topk(q_i, w_i, k_i, q_pos, q_seg, k_pos, k_seg, k, qb, kb):
    fn = lambda *a: topk_ops.blockwise_topk(*a, k, qb, kb)  # noqa: E731
    b3, b2 = ("batch", None, None), ("batch", None)
    return per_shard(fn, (q_i, w_i, k_i, q_pos, q_seg, k_pos, k_seg),
                     (b3 + (None,), b3, b3, b2, b2, b2, b2), (b3, b3))

  def attend(q_lat, q_rope, latent, k_rope, idx, valid, scale, qb):
    fn = lambda *a: attn_ops.sparse_mqa_attention(*a, scale, qb)  # noqa: E731
    b4, b3 = ("batch", None, None, None), ("batch", None, None)
    return per_shard(fn, (q_lat, q_rope, latent, k_rope, idx, valid), (b4, b4, b3, b3, b3, b3),
                     (b4, b3))

  return topk, attend


@flax.struct.dataclass
class DSACache:
  """Decode state of one Gated DSA layer; slot i holds the token at position i.

  latent [b, max_len, kv_lora_rank], k_rope [b, max_len, qk_rope_dim] and
  index_k [b, max_len, index_head_dim] in the cache dtype; lengths [b] int32
  counts the filled slots per row.
  """
  latent: jax.Array
  k_rope: jax.Array
  index_k: jax.Array
  lengths: jax.Array

  @property
  def max_len(self) -> int:
    return self.latent.shape[1]


class LayerNorm(nnx.Module):
  """LayerNorm (scale and bias) in f32; DeepSeek-V3.2 normalises the indexer key with it."""

  def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, param_dtype):
    self.eps = eps
    self.scale = param(rngs, (dim,), ("norm",), param_dtype, init="ones")
    self.bias = param(rngs, (dim,), ("norm",), param_dtype, init="zeros")

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    y = (xf - mu) * jax.lax.rsqrt(var + self.eps)
    y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
    return y.astype(x.dtype)


def _partial_rope(x: jax.Array, positions: jax.Array, dim: int, theta: float) -> jax.Array:
  """RoPE on the first `dim` channels of x's last axis, the rest unchanged."""
  return jnp.concatenate([apply_rope(x[..., :dim], positions, theta), x[..., dim:]], axis=-1)


class GatedDSA(nnx.Module):
  """Gated DSA attention layer (see the module docstring)."""

  # Attributes that belong to the lightning indexer (parameter accounting,
  # and the warm-up stage in which only the indexer trains).
  INDEXER_PARAMS = ("w_qi", "w_ki", "index_k_norm", "w_w")

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pd = cfg.jnp_param_dtype
    d, h, ql, c = cfg.d_model, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    rope = cfg.qk_rope_dim
    # MLA.
    self.w_dq = param(rngs, (d, ql), ("embed", "q_lora"), pd)
    self.q_norm = RMSNorm(ql, cfg.norm_eps, rngs=rngs, param_dtype=pd)
    self.w_uq = param(rngs, (ql, h, cfg.qk_nope_dim + rope), ("q_lora", "heads", "head_dim"), pd)
    self.w_dkv = param(rngs, (d, c + rope), ("embed", "kv_lora"), pd)
    self.kv_norm = RMSNorm(c, cfg.norm_eps, rngs=rngs, param_dtype=pd)
    self.w_uk = param(rngs, (c, h, cfg.qk_nope_dim), ("kv_lora", "heads", "head_dim"), pd)
    self.w_uv = param(rngs, (c, h, cfg.v_head_dim), ("kv_lora", "heads", "head_dim"), pd)
    # Output gate and projection.
    self.w_g = param(rngs, (d, h, cfg.v_head_dim), ("embed", "heads", "head_dim"), pd)
    self.w_o = param(rngs, (h, cfg.v_head_dim, d), ("heads", "head_dim", "embed"), pd,
                     fan_in=h * cfg.v_head_dim)
    # Lightning indexer.
    hi, di = cfg.index_heads, cfg.index_head_dim
    self.w_qi = param(rngs, (ql, hi, di), ("q_lora", "heads", "head_dim"), pd)
    self.w_ki = param(rngs, (d, di), ("embed", "head_dim"), pd)
    self.index_k_norm = LayerNorm(di, cfg.norm_eps, rngs=rngs, param_dtype=pd)
    self.w_w = param(rngs, (d, hi), ("embed", "heads"), pd)

  @property
  def scale(self) -> float:
    return (self.cfg.qk_nope_dim + self.cfg.qk_rope_dim) ** -0.5

  # ---- projections ---------------------------------------------------------
  def mla_projections(self, x: jax.Array, positions: jax.Array):
    """x [b,t,d] -> c_q [b,t,r], q_lat [b,t,h,c], q_rope [b,t,h,p], latent [b,t,c], k_rope [b,t,p]."""
    cfg, dt = self.cfg, self.cfg.jnp_dtype
    c_q = self.q_norm(einsum("btd,dr->btr", x, self.w_dq[...], dt))
    q = einsum("btr,rhk->bthk", c_q, self.w_uq[...], dt)
    q_nope, q_rope = q[..., :cfg.qk_nope_dim], q[..., cfg.qk_nope_dim:]
    q_rope = apply_rope(q_rope, positions, cfg.rope_theta)
    q_lat = einsum("bthk,chk->bthc", q_nope, self.w_uk[...], dt)
    kv = einsum("btd,dc->btc", x, self.w_dkv[...], dt)
    latent = self.kv_norm(kv[..., :cfg.kv_lora_rank])
    k_rope = apply_rope(kv[..., cfg.kv_lora_rank:], positions, cfg.rope_theta)
    return c_q, q_lat, q_rope, latent, k_rope

  def indexer_projections(self, x: jax.Array, c_q: jax.Array, positions: jax.Array):
    """Lightning indexer on detached inputs -> q_i [b,t,h,k], w_i [b,t,h], k_i [b,t,k]."""
    cfg, dt = self.cfg, self.cfg.jnp_dtype
    x, c_q = jax.lax.stop_gradient(x), jax.lax.stop_gradient(c_q)
    q_i = einsum("btr,rhk->bthk", c_q, self.w_qi[...], dt)
    q_i = _partial_rope(q_i, positions, cfg.qk_rope_dim, cfg.rope_theta)
    k_i = self.index_k_norm(einsum("btd,dk->btk", x, self.w_ki[...], dt))
    k_i = _partial_rope(k_i, positions, cfg.qk_rope_dim, cfg.rope_theta)
    w_i = einsum("btd,dh->bth", x, self.w_w[...], dt) * cfg.index_heads ** -0.5
    return q_i, w_i, k_i

  def output_projection(self, out_lat: jax.Array, x: jax.Array) -> jax.Array:
    """out_lat [b,t,h,c] -> y [b,t,d]: value up-projection, sigmoid gate, W_o."""
    dt = self.cfg.jnp_dtype
    o = einsum("bthc,chv->bthv", out_lat, self.w_uv[...], dt)
    gate = jax.nn.sigmoid(einsum("btd,dhv->bthv", x, self.w_g[...], dt).astype(jnp.float32))
    return einsum("bthv,hvd->btd", (o.astype(jnp.float32) * gate).astype(dt), self.w_o[...], dt)

  # ---- attention stages ------------------------------------------------------
  def _sparse(self, q_lat, q_rope, latent, k_rope, q_i, w_i, k_i, q_pos, q_seg, k_pos, k_seg,
              with_loss: bool):
    """Top-k selection + sparse MQA; optionally the sparse-stage indexer KL."""
    cfg = self.cfg
    topk = min(cfg.index_topk, latent.shape[1])
    topk_fn, attend_fn = _kernels(cfg.use_pallas)
    idx, valid = topk_fn(q_i, w_i, k_i, q_pos, q_seg, k_pos, k_seg, topk,
                         cfg.dsa_query_block, cfg.dsa_key_block)
    out_lat, p_sel = attend_fn(q_lat, q_rope, latent, k_rope, idx, valid, self.scale,
                               cfg.dsa_query_block)
    if not with_loss:
      return out_lat, None
    logits = sparse.selected_indexer_scores(q_i, w_i, k_i, idx, cfg.dsa_query_block)
    return out_lat, sparse.indexer_kl(p_sel, logits, valid)

  def _dense(self, q_lat, q_rope, latent, k_rope, q_i, w_i, k_i, q_pos, q_seg, k_pos, k_seg,
             topk: int | None = None):
    """Dense MLA and the KL of the dense indexer scores over the attended keys: every allowed key
    (the warm-up stage, or top-k covering them all), or with `topk` the sparse stage's maths
    under its exact top-k mask (sparse.topk_mask)."""
    mask = allowed_mask(q_pos, q_seg, k_pos, k_seg)
    with jax.named_scope(F32_SCOPE):  # the indexer's dense scores and KL run in f32
      scores = indexer_scores_dense(q_i, w_i, k_i)
      if topk is not None:
        mask = sparse.topk_mask(scores, mask, topk)
    out_lat, p = dense_mqa_attention(q_lat, q_rope, latent, k_rope, mask, self.scale)
    with jax.named_scope(F32_SCOPE):
      return out_lat, sparse.indexer_kl(p, scores, mask)

  # ---- public API ------------------------------------------------------------
  def _check_x(self, fn: str, x: jax.Array) -> None:
    if x.ndim != 3 or x.shape[-1] != self.cfg.d_model or 0 in x.shape:
      raise ValueError(f"GatedDSA.{fn}: x must be [batch >= 1, time >= 1, d_model={self.cfg.d_model}], "
                       f"got shape {x.shape}.")

  def __call__(self, x: jax.Array, positions: jax.Array,
               segment_ids: jax.Array) -> tuple[jax.Array, dict]:
    """Training / full-sequence forward.

    Args:
      x: [b, t, d] input activations.
      positions: [b, t] int RoPE positions (restart per packed segment).
      segment_ids: [b, t] int packed-segment ids; tokens attend only within
        their segment and causally by sequence index (negative ids attend to
        nothing and are never attended to).

    Returns:
      y [b, t, d] and aux {'indexer_loss': f32 scalar}.
    """
    self._check_x("__call__", x)
    for name, arr in (("positions", positions), ("segment_ids", segment_ids)):
      if arr.shape != x.shape[:2] or not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"GatedDSA.__call__: {name} must be an int array of shape [b, t]="
                         f"{x.shape[:2]}, got {arr.dtype}{list(arr.shape)}.")
    c_q, q_lat, q_rope, latent, k_rope = self.mla_projections(x, positions)
    q_i, w_i, k_i = self.indexer_projections(x, c_q, positions)
    # Keys and queries are the same sequence: causal order is the sequence index.
    seq = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])
    args = (q_lat, q_rope, latent, k_rope, q_i, w_i, k_i, seq, segment_ids, seq, segment_ids)
    # Where top-k covers every key (train lengths up to index_topk), the sparse stage selects
    # all allowed keys: its attention and its KL over the selected keys are the dense stage's
    # maths, which one dense MQA computes at a fraction of the cost of gathering every key per
    # query (tests/test_dsa.py checks forward and gradients against the sparse path). Up to
    # dsa_dense_len tokens the sparse stage runs as that dense MQA under its top-k mask.
    if self.cfg.indexer_stage == "dense_warmup" or self.cfg.index_topk >= x.shape[1]:
      out_lat, loss = self._dense(*args)
    elif x.shape[1] <= self.cfg.dsa_dense_len:
      out_lat, loss = self._dense(*args, topk=self.cfg.index_topk)
    else:
      out_lat, loss = self._sparse(*args, with_loss=True)
    return self.output_projection(out_lat, x), {"indexer_loss": loss}

  def init_cache(self, batch: int, max_len: int, dtype=None) -> DSACache:
    """An empty cache: zeros, lengths 0. dtype defaults to the compute dtype."""
    if batch <= 0 or max_len <= 0:
      raise ValueError(f"GatedDSA.init_cache: batch={batch} and max_len={max_len} must be > 0.")
    cfg, dtype = self.cfg, dtype or self.cfg.jnp_dtype
    return DSACache(latent=jnp.zeros((batch, max_len, cfg.kv_lora_rank), dtype),
                    k_rope=jnp.zeros((batch, max_len, cfg.qk_rope_dim), dtype),
                    index_k=jnp.zeros((batch, max_len, cfg.index_head_dim), dtype),
                    lengths=jnp.zeros((batch,), jnp.int32))

  def _check_extend(self, x: jax.Array, valid: jax.Array, cache: DSACache) -> None:
    self._check_x("extend", x)
    b, t = x.shape[:2]
    if valid.shape != (b, t) or valid.dtype != jnp.bool_:
      raise ValueError(f"GatedDSA.extend: valid must be a bool [b, t]={(b, t)} prefix mask, "
                       f"got {valid.dtype}{list(valid.shape)}.")
    if cache.lengths.shape != (b,):
      raise ValueError(f"GatedDSA.extend: cache is for batch {cache.lengths.shape[0]}, x has "
                       f"batch {b}; build it with init_cache(batch={b}, ...).")
    if t > cache.max_len:
      raise ValueError(f"GatedDSA.extend: {t} new tokens exceed the cache's max_len={cache.max_len}; "
                       "use a larger init_cache(max_len=...).")
    check_prefix_mask(valid, "GatedDSA.extend")
    if not isinstance(cache.lengths, jax.core.Tracer) and not isinstance(valid, jax.core.Tracer):
      need = int(jnp.max(cache.lengths + jnp.sum(valid, axis=1)))
      if need > cache.max_len:
        raise ValueError(f"GatedDSA.extend: a row would hold {need} tokens > max_len={cache.max_len}; "
                         "use a larger init_cache(max_len=...).")

  def extend(self, x: jax.Array, valid: jax.Array, cache: DSACache) -> tuple[jax.Array, DSACache]:
    """Appends t tokens per row to the cache and attends over it (prefill chunk or decode step).

    Args:
      x: [b, t, d] new tokens' activations.
      valid: [b, t] bool prefix mask of real tokens (rows may add different
        counts); invalid rows are not cached and their outputs are garbage.
      cache: DSACache from init_cache or a previous extend.

    Returns:
      y [b, t, d] and the updated cache (lengths += valid.sum(1)).
    """
    self._check_extend(x, valid, cache)
    b, t = x.shape[:2]
    positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
    c_q, q_lat, q_rope, latent, k_rope = self.mla_projections(x, positions)
    q_i, w_i, k_i = self.indexer_projections(x, c_q, positions)
    rows = jnp.arange(b)[:, None]
    slot = jnp.where(valid, positions, cache.max_len)  # out of range -> dropped

    def write(buf, new):
      return scatter_set(buf, (rows, slot), new, mode="drop")

    lengths = cache.lengths + jnp.sum(valid, axis=1, dtype=jnp.int32)
    cache = DSACache(latent=write(cache.latent, latent), k_rope=write(cache.k_rope, k_rope),
                     index_k=write(cache.index_k, k_i), lengths=lengths)
    k_pos = jnp.broadcast_to(jnp.arange(cache.max_len, dtype=jnp.int32), (b, cache.max_len))
    k_seg = jnp.where(k_pos < lengths[:, None], 0, -1)
    out_lat, _ = self._sparse(q_lat, q_rope, cache.latent, cache.k_rope, q_i, w_i, cache.index_k,
                              positions, jnp.zeros((b, t), jnp.int32), k_pos, k_seg, with_loss=False)
    return self.output_projection(out_lat, x), cache
