"""Delta attention: the Gated DeltaNet token mixer (gated delta rule + short conv + output gate).

Gated DeltaNet (Yang, Kautz & Hatamizadeh, ICLR 2025, "Gated Delta Networks: Improving Mamba2
with Delta Rule"), in the layout Qwen3-Next and Kimi Linear use in hybrid stacks:

  * q, k, v come from linear projections followed by a depthwise causal conv (width
    delta_conv_size) and SiLU: the short conv gives the linear-attention memory cheap local
    n-gram features it cannot form on its own.
  * q and k are L2-normalised per head (and q scaled by kd^-1/2) so the delta-rule update
    S <- S + beta k (v - S^T k)^T is a contraction for beta in (0, 1): the memory stays
    bounded over a 1M-token context without a softmax normaliser.
  * beta = sigmoid(x W_beta) is the per-token write strength; the decay is Mamba2's
    g = -exp(A_log) * softplus(x W_a + dt_bias) (<= 0), so every head has its own time scale.
  * value heads may outnumber q/k heads (GQA-style sharing: value head j reads q/k head
    j // (hv / hqk)).
  * the output is RMS-normalised per head and gated by silu(x W_z) before the output
    projection, which keeps per-head output scales comparable across heads and lets the
    layer switch itself off per token.

Training and prefill use the chunkwise WY/UT form and decode the recurrent form of the same
function (model/attention/delta_rule.py). Packed sequences reset the state at segment starts,
and the causal conv never mixes tokens of different segments. The decode cache is fixed-size:
the [hv, kd, vd] state and the pre-conv inputs of the last delta_conv_size - 1 tokens.

Einsum legend: b batch, t token, d model dim, h heads, k key (q/k head) dim, v value head dim.
"""

from __future__ import annotations

import functools
import math

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from model.attention.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from model.config import ModelConfig
from model.layers import check_prefix_mask, einsum, param, rms_norm
from sharding.rules import per_shard

L2_EPS = 1e-6


def _chunk_rule(use_pallas: bool):
  """The chunked gated delta rule: the Pallas kernel or the XLA path."""
  if not use_pallas:
    return chunk_gated_delta_rule
  from pallas_kernels.delta_rule import ops  # noqa: PLC0415 - optional backend

  def rule(q, k, v, g, beta, initial_state=None, reset=None, chunk_size=64):
    """The kernel on each device's (batch rows, heads) shard (sharding.rules.per_shard)."""
    b, _, h, kd = q.shape
    state = (jnp.zeros((b, h, kd, v.shape[-1]), jnp.float32) if initial_state is None
             else initial_state)
    rst = jnp.zeros(q.shape[:2], bool) if reset is None else reset
    fn = lambda q, k, v, g, beta, s, r: ops.chunk_gated_delta_rule(  # noqa: E731
        q, k, v, g, beta, initial_state=s, reset=r, chunk_size=chunk_size)
    t4, t3 = ("batch", None, "heads", None), ("batch", None, "heads")
    st = ("batch", "heads", None, None)
    return per_shard(fn, (q, k, v, g, beta, state, rst), (t4, t4, t4, t3, t3, st, ("batch", None)),
                     (t4, st))

  return rule


@flax.struct.dataclass
class DeltaCache:
  """Decode state of one delta layer.

  state: [b, hv, kd, vd] float32 recurrent memory.
  conv: [b, delta_conv_size - 1, conv_channels] pre-conv q|k|v inputs of the last
    delta_conv_size - 1 tokens (compute dtype), oldest first.
  """
  state: jax.Array
  conv: jax.Array


def _param_from(rngs: nnx.Rngs, value: jax.Array, axes, dtype) -> nnx.Param:
  """A parameter with logical axes whose initial value is given (not a layers.param init)."""
  p = param(rngs, value.shape, axes, dtype, init="zeros")
  p[...] = value.astype(dtype)
  return p


def _l2_normalize(x: jax.Array) -> jax.Array:
  """x / ||x|| over the last dim, in f32 (eps inside the root keeps it smooth at 0)."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def conv_masks(segment_ids: jax.Array, width: int) -> jax.Array:
  """Which conv taps may read their token: [width, b, t] bool.

  Tap i reads the token `width - 1 - i` steps back; it is allowed iff that token exists and
  lies in the same segment as the current one.
  """
  b, t = segment_ids.shape
  seg = jnp.pad(segment_ids, ((0, 0), (width - 1, 0)))
  exists = jnp.pad(jnp.ones((b, t), bool), ((0, 0), (width - 1, 0)))
  return jnp.stack([exists[:, i:i + t] & (seg[:, i:i + t] == segment_ids) for i in range(width)])


def segment_resets(segment_ids: jax.Array) -> jax.Array:
  """reset[b, t] = (t == 0) or segment_ids[b, t] != segment_ids[b, t - 1]."""
  first = jnp.ones(segment_ids.shape[:1] + (1,), bool)
  return jnp.concatenate([first, segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


class DeltaAttention(nnx.Module):
  """Gated DeltaNet attention layer; see the module docstring."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, hqk, hv = cfg.d_model, cfg.delta_qk_heads, cfg.delta_v_heads
    kd, vd, width = cfg.delta_qk_dim, cfg.delta_v_dim, cfg.delta_conv_size
    pd = cfg.jnp_param_dtype
    self.w_q = param(rngs, (d, hqk, kd), ("embed", "heads", "head_dim"), pd)
    self.w_k = param(rngs, (d, hqk, kd), ("embed", "heads", "head_dim"), pd)
    self.w_v = param(rngs, (d, hv, vd), ("embed", "heads", "head_dim"), pd)
    self.w_z = param(rngs, (d, hv, vd), ("embed", "heads", "head_dim"), pd)
    self.w_beta = param(rngs, (d, hv), ("embed", "heads"), pd)
    self.w_a = param(rngs, (d, hv), ("embed", "heads"), pd)
    # Decay parameters stay f32 whatever param_dtype is: the decay exponent is summed over
    # thousands of tokens, and bf16 rounding of A_log (~0.4%) would shift every head's
    # memory horizon. A = exp(A_log) ~ U(1, 16) and dt ~ logU(1e-3, 1e-1) as in Mamba2.
    a_init = jax.random.uniform(rngs.params(), (hv,), jnp.float32, 1.0, 16.0)
    self.A_log = _param_from(rngs, jnp.log(a_init), ("heads",), jnp.float32)
    log_dt = jax.random.uniform(rngs.params(), (hv,), jnp.float32, math.log(1e-3), math.log(1e-1))
    dt = jnp.maximum(jnp.exp(log_dt), 1e-4)
    self.dt_bias = _param_from(rngs, dt + jnp.log(-jnp.expm1(-dt)), ("heads",), jnp.float32)
    # Depthwise conv over the concatenated q|k|v channels; tap width-1 is the current token.
    self.conv_w = param(rngs, (width, self.conv_channels), ("conv", "heads"), pd, fan_in=width)
    self.norm_scale = param(rngs, (vd,), ("norm",), pd, init="ones")
    self.w_o = param(rngs, (hv, vd, d), ("heads", "head_dim", "embed"), pd, fan_in=hv * vd)

  @property
  def conv_channels(self) -> int:
    cfg = self.cfg
    return 2 * cfg.delta_qk_heads * cfg.delta_qk_dim + cfg.delta_v_heads * cfg.delta_v_dim

  # ---- pieces shared by __call__ and extend ---------------------------------------------
  def _check(self, x: jax.Array, name: str, other: jax.Array | None = None, other_name: str = ""):
    d = self.cfg.d_model
    if x.ndim != 3 or x.shape[-1] != d or 0 in x.shape[:2]:
      raise ValueError(f"DeltaAttention: {name} has shape {x.shape}; expected [b >= 1, t >= 1, "
                       f"d_model={d}].")
    if other is not None and other.shape != x.shape[:2]:
      raise ValueError(f"DeltaAttention: {other_name} has shape {other.shape}; expected [b, t] = "
                       f"{x.shape[:2]} to match {name}.")

  def _project(self, x: jax.Array):
    """x [b, t, d] -> pre-conv q|k|v [b, t, C], gate z [b, t, hv, vd], beta, g [b, t, hv] f32."""
    dt = self.cfg.jnp_dtype
    b, t, _ = x.shape
    q = einsum("btd,dhk->bthk", x, self.w_q[...], dt).reshape(b, t, -1)
    k = einsum("btd,dhk->bthk", x, self.w_k[...], dt).reshape(b, t, -1)
    v = einsum("btd,dhv->bthv", x, self.w_v[...], dt).reshape(b, t, -1)
    z = einsum("btd,dhv->bthv", x, self.w_z[...], dt)
    beta = jax.nn.sigmoid(einsum("btd,dh->bth", x, self.w_beta[...], dt).astype(jnp.float32))
    a = einsum("btd,dh->bth", x, self.w_a[...], dt).astype(jnp.float32)
    g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a + self.dt_bias[...])
    return jnp.concatenate([q, k, v], axis=-1), z, beta, g

  def _conv(self, history_and_x: jax.Array, masks: jax.Array | None) -> jax.Array:
    """Depthwise causal conv + SiLU, f32 sums: [b, width-1+t, C] -> [b, t, C] compute dtype.

    masks: [width, b, t] bool (tap i may read its token) or None (all taps allowed).
    """
    w = self.conv_w[...].astype(jnp.float32)
    width = w.shape[0]
    t = history_and_x.shape[1] - (width - 1)
    xf = history_and_x.astype(jnp.float32)
    out = jnp.zeros(xf.shape[:1] + (t,) + xf.shape[2:], jnp.float32)
    for i in range(width):
      tap = xf[:, i:i + t] * w[i]
      out = out + (tap if masks is None else jnp.where(masks[i][..., None], tap, 0.0))
    return jax.nn.silu(out).astype(self.cfg.jnp_dtype)

  def _heads(self, feats: jax.Array):
    """Conv features [b, t, C] -> q, k [b, t, hv, kd] (normalised, q scaled), v [b, t, hv, vd] f32."""
    cfg = self.cfg
    b, t, _ = feats.shape
    nq = cfg.delta_qk_heads * cfg.delta_qk_dim
    q = feats[..., :nq].reshape(b, t, cfg.delta_qk_heads, cfg.delta_qk_dim)
    k = feats[..., nq:2 * nq].reshape(b, t, cfg.delta_qk_heads, cfg.delta_qk_dim)
    v = feats[..., 2 * nq:].reshape(b, t, cfg.delta_v_heads, cfg.delta_v_dim).astype(jnp.float32)
    q = _l2_normalize(q) * cfg.delta_qk_dim ** -0.5
    k = _l2_normalize(k)
    groups = cfg.delta_v_heads // cfg.delta_qk_heads
    return jnp.repeat(q, groups, axis=2), jnp.repeat(k, groups, axis=2), v

  def _output(self, o: jax.Array, z: jax.Array) -> jax.Array:
    """o [b, t, hv, vd] f32, z [b, t, hv, vd] -> y [b, t, d]: per-head RMSNorm * silu(z), out proj."""
    cfg = self.cfg
    gated = rms_norm(o, self.norm_scale[...], cfg.norm_eps) * jax.nn.silu(z.astype(jnp.float32))
    return einsum("bthv,hvd->btd", gated, self.w_o[...], cfg.jnp_dtype)

  # ---- public -------------------------------------------------------------------------
  def __call__(self, x: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None):
    """Full-sequence forward (training, scoring).

    Args:
      x: [b, t, d_model].
      positions: [b, t] int; unused (the recurrence is position-free), kept for the
        uniform attention interface.
      segment_ids: [b, t] int or None (one segment); state and conv restart where it changes.

    Returns:
      y [b, t, d_model] in the compute dtype, aux {} (no auxiliary losses).
    """
    del positions
    cfg = self.cfg
    b, t = x.shape[:2] if x.ndim == 3 else (0, 0)
    if segment_ids is None:
      segment_ids = jnp.zeros((b, t), jnp.int32)
    self._check(x, "x", segment_ids, "segment_ids")
    pre, z, beta, g = self._project(x)
    history = jnp.zeros((b, cfg.delta_conv_size - 1, pre.shape[-1]), pre.dtype)
    feats = self._conv(jnp.concatenate([history, pre], axis=1),
                       conv_masks(segment_ids, cfg.delta_conv_size))
    q, k, v = self._heads(feats)
    o, _ = _chunk_rule(cfg.use_pallas)(q, k, v, g, beta, reset=segment_resets(segment_ids),
                                  chunk_size=cfg.delta_chunk_size)
    return self._output(o, z), {}

  def init_cache(self, batch: int, max_len: int, dtype=None) -> DeltaCache:
    """An empty cache (zero state, zero conv history). max_len is unused: the state is fixed-size.

    dtype: dtype of the conv history (default: the compute dtype); the state is always f32.
    """
    del max_len
    cfg = self.cfg
    return DeltaCache(
        state=jnp.zeros((batch, cfg.delta_v_heads, cfg.delta_qk_dim, cfg.delta_v_dim), jnp.float32),
        conv=jnp.zeros((batch, cfg.delta_conv_size - 1, self.conv_channels), dtype or cfg.jnp_dtype))

  def extend(self, x: jax.Array, valid: jax.Array, cache: DeltaCache):
    """Continues each row from `cache` with its valid tokens (prefill chunk or decode step).

    Args:
      x: [b, t, d_model] new tokens.
      valid: [b, t] bool, a prefix mask per row (right padding); invalid tokens leave the
        state and conv history unchanged and get arbitrary (finite) outputs.
      cache: DeltaCache from init_cache or a previous extend.

    Returns:
      y [b, t, d_model], the updated DeltaCache. t == 1 runs the recurrent decode step,
      longer inputs the chunked form.
    """
    cfg = self.cfg
    self._check(x, "x", valid, "valid")
    self._check_cache(cache, x.shape[0])
    check_prefix_mask(valid, "DeltaAttention.extend")
    width = cfg.delta_conv_size
    pre, z, beta, g = self._project(x)
    history_and_x = jnp.concatenate([cache.conv.astype(pre.dtype), pre], axis=1)
    q, k, v = self._heads(self._conv(history_and_x, None))
    keep = valid.astype(jnp.float32)[..., None]
    if x.shape[1] == 1:
      rule = recurrent_gated_delta_rule
    else:
      rule = functools.partial(_chunk_rule(cfg.use_pallas), chunk_size=cfg.delta_chunk_size)
    o, state = rule(q, k, v, g * keep, beta * keep, initial_state=cache.state)
    # The last width-1 valid inputs of history|x start at index n_valid (older ones come from
    # the previous history when a row has fewer than width-1 new valid tokens).
    n_valid = jnp.sum(valid.astype(jnp.int32), axis=1)
    idx = n_valid[:, None] + jnp.arange(width - 1)[None, :]
    conv = jnp.take_along_axis(history_and_x, idx[..., None], axis=1)
    return self._output(o, z), DeltaCache(state=state, conv=conv.astype(cache.conv.dtype))

  def _check_cache(self, cache: DeltaCache, batch: int) -> None:
    cfg = self.cfg
    want_state = (batch, cfg.delta_v_heads, cfg.delta_qk_dim, cfg.delta_v_dim)
    want_conv = (batch, cfg.delta_conv_size - 1, self.conv_channels)
    if cache.state.shape != want_state or cache.conv.shape != want_conv:
      raise ValueError(f"DeltaAttention.extend: cache has state {cache.state.shape} and conv "
                       f"{cache.conv.shape}; expected {want_state} and {want_conv}. Build it with "
                       f"init_cache(batch={batch}, ...) of this layer.")
