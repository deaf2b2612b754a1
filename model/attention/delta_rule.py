"""The gated delta rule's XLA forms: recurrent (decode) and chunkwise (WY/UT).

Gated DeltaNet (Yang, Kautz & Hatamizadeh, ICLR 2025, "Gated Delta Networks: Improving Mamba2
with Delta Rule") keeps a fixed-size associative memory S per head and, per token t, first
decays it (the Mamba2 gate a_t = exp(g_t), g_t <= 0) and then applies one delta-rule step:
it reads the value the memory currently predicts for key k_t and writes back a beta_t-sized
correction towards v_t:

    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T,      o_t = S_t^T q_t.

The decay forgets quickly on a context switch; the delta correction edits single associations
without wiping the memory. Token by token this is a sequential scan (the decode form). For
training and prefill the chunkwise-parallel form of DeltaNet (Yang et al., NeurIPS 2024,
"Parallelizing Linear Transformers with the Delta Rule over Sequence Length") rewrites a chunk
of C tokens with the WY/UT representation: the chunk's pseudo-values u solve a unit lower
triangular system, so the work inside a chunk is matmuls and one small unit-lower-triangular
inverse, and only the [k, v] state crosses chunk boundaries (a lax.scan over chunks). Both forms
compute the function of the per-token reference, which lives beside the Pallas kernel with the
shared argument checks (pallas_kernels/delta_rule/reference.py: `naive_gated_delta_rule`); tests
check outputs and every gradient against it.

Packed sequences: reset[b, t] zeroes the state before token t is applied. The chunk form
handles resets inside a chunk exactly with "same segment" masks rather than a -inf (or -1e4)
log-decay at the reset token, which would wreck the f32 cumulative log-decay of the chunk.

How the chunked form is laid out (issue 16: nothing inside a chunk loops over rows): a
lax.scan takes a few chunks per step (CHUNKS_PER_STEP) and runs their intra-chunk work as
batched matmuls over [chunks, batch, heads], then carries the state through them; the
in-chunk cumulative log-decays are one matmul with a lower-triangular ones matrix (XLA:CPU
lowers jnp.cumsum to reduce-window chains); (I + A)^-1 is a log-depth halving recursion whose
8 x 8 leaves use the nilpotent product (I + N)(I + N^2)(I + N^4); the solve
x = (I + A)^-1 [beta gamma k | beta v] has an analytic VJP, so the backward never
differentiates the inverse; only the state recurrence is sequential (the scan, differentiated
by autodiff through a checkpointed step, which keeps one [k, v] state per step).

All maths runs in float32 whatever the input dtype: the decay is an exponent summed over the
sequence, the state sums decayed updates over the whole sequence, and the UT inverse and the
pseudo-values feed every later chunk through it. A bf16-input variant of these matmuls has not
been measured against the 1e-5 agreement the tests hold. Outputs come back in v's dtype and
states in float32.

Einsum legend: b batch, n chunk index, t query position (in a chunk), s key position (in a
chunk), r a third in-chunk position (matrix products in the triangular inverse), h heads,
k key dim, v value dim, x k and v dims side by side.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from model.layers import F32_SCOPE, einsum
from pallas_kernels.delta_rule.reference import check_inputs, initial_state_or_zeros

# Diagonal blocks up to this size are inverted by the product form (log-depth matmuls);
# larger ones are split in halves and merged with matmuls.
_PRODUCT_BLOCK = 8


@jax.named_scope(F32_SCOPE)
def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, reset=None):
  """Recurrent form: lax.scan over tokens; with t == 1 it is one decode step.

  Same arguments and results as the reference `naive_gated_delta_rule`
  (pallas_kernels/delta_rule/reference.py). O(t) sequential steps, O(1) memory in t beyond
  the outputs.
  """
  check_inputs("recurrent_gated_delta_rule", q, k, v, g, beta, initial_state, reset)
  dt = jnp.float32
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  if reset is None:
    reset = jnp.zeros((b, t), bool)
  xs = tuple(jnp.moveaxis(x.astype(dt), 1, 0) for x in (q, k, v, g, beta))
  xs = xs + (jnp.moveaxis(reset, 1, 0),)

  def step(s, inp):
    q_i, k_i, v_i, g_i, beta_i, reset_i = inp
    s = jnp.where(reset_i[:, None, None, None], 0.0, s) * jnp.exp(g_i)[..., None, None]
    u = beta_i[..., None] * (v_i - einsum("bhkv,bhk->bhv", s, k_i, dt))
    s = s + k_i[..., :, None] * u[..., None, :]
    return s, einsum("bhkv,bhk->bhv", s, q_i, dt)

  s, o = jax.lax.scan(step, initial_state_or_zeros(initial_state, b, h, kd, vd, dt), xs)
  return jnp.moveaxis(o, 0, 1).astype(v.dtype), s


def _product_inverse(a):
  """(I + a)^-1 for strictly lower-triangular a [..., m, m], in ceil(log2 m) - 1 doublings.

  N = -a is nilpotent (N^m = 0), so (I + a)^-1 = sum_j N^j = (I + N)(I + N^2)(I + N^4)...:
  2 (ceil(log2 m) - 1) matmuls instead of m - 1 dependent row updates.
  """
  m = a.shape[-1]
  dt = a.dtype
  power = -a
  inv = jnp.eye(m, dtype=dt) + power
  for _ in range(max(0, math.ceil(math.log2(m)) - 1)):
    power = einsum("...ts,...sr->...tr", power, power, dt)
    inv = inv + einsum("...ts,...sr->...tr", inv, power, dt)
  return inv


def _blocked_inverse(a):
  """(I + a)^-1 by halving: [[T11, 0], [-T22 a21 T11, T22]], both halves in one batch.

  m is a power of two. Blocks up to _PRODUCT_BLOCK use the product form; the recursion is
  log-depth, so no loop runs over rows.
  """
  m = a.shape[-1]
  if m <= _PRODUCT_BLOCK:
    return _product_inverse(a)
  h = m // 2
  diag = _blocked_inverse(jnp.stack([a[..., :h, :h], a[..., h:, h:]]))
  t11, t22 = diag[0], diag[1]
  a21_t11 = einsum("...ts,...sr->...tr", a[..., h:, :h], t11, a.dtype)
  t21 = -einsum("...ts,...sr->...tr", t22, a21_t11, a.dtype)
  top = jnp.concatenate([t11, jnp.zeros_like(t11)], axis=-1)
  return jnp.concatenate([top, jnp.concatenate([t21, t22], axis=-1)], axis=-2)


def unit_lower_inverse(a):
  """(I + a)^-1 for a [..., m, m] whose strictly lower triangle is used (the rest is ignored).

  Matmuls only (halving + product form), no row loop and no LAPACK: the batched trsm behind
  jax.lax.linalg.triangular_solve took 45 ms for 1,024 32 x 32 systems (48 right-hand sides)
  on XLA:CPU, several times this whole inverse, and hung in an earlier forward+backward
  benchmark (ParallelBatchMap waiting on the XLA thread pool).
  m that is not a power of two is padded with identity rows, which leave the inverse's
  leading block unchanged.
  """
  m = a.shape[-1]
  size = 1 << max(0, (m - 1).bit_length())
  a = jnp.tril(a, -1)
  if size != m:
    widths = [(0, 0)] * (a.ndim - 2) + [(0, size - m), (0, size - m)]
    return _blocked_inverse(jnp.pad(a, widths))[..., :m, :m]
  return _blocked_inverse(a)


@jax.custom_vjp
def unit_lower_solve(a, rhs):
  """x = (I + a)^-1 rhs for a [..., m, m] (strictly lower triangle used), rhs [..., m, x].

  The VJP is analytic: d rhs = T^T dx and da = -strictly_lower(d rhs x^T), so the backward
  never differentiates the inverse (two m x m x x matmuls instead of the inverse's chain).
  """
  return einsum("...ts,...sx->...tx", unit_lower_inverse(a), rhs, rhs.dtype)


def _unit_lower_solve_fwd(a, rhs):
  inv = unit_lower_inverse(a)
  x = einsum("...ts,...sx->...tx", inv, rhs, rhs.dtype)
  return x, (inv, x)


def _unit_lower_solve_bwd(res, dx):
  inv, x = res
  dt = x.dtype
  drhs = einsum("...st,...sx->...tx", inv, dx, dt)
  return -jnp.tril(einsum("...tx,...sx->...ts", drhs, x, dt), -1), drhs


unit_lower_solve.defvjp(_unit_lower_solve_fwd, _unit_lower_solve_bwd)


def _to_chunks(x, n: int, c: int):
  """[b, n*c, h, ...] -> [n, b, h, c, ...]; [b, n*c] -> [n, b, c]."""
  x = x.reshape((x.shape[0], n, c) + x.shape[2:])
  if x.ndim == 3:
    return jnp.moveaxis(x, 1, 0)
  return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2)


def _pad_time(x, pad: int, value=0):
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _chunk_terms(q, k, v, g, beta, reset):
  """Everything about a chunk that does not depend on the carried-in state.

  Inputs are chunked: q, k [n, b, h, c, k]; v [n, b, h, c, v]; g, beta [n, b, h, c];
  reset [n, b, c] or None. Within a chunk, G_t = sum_{s<=t} g_s, and tokens t, s interact iff
  no reset lies in (s, t] (equal running reset count). With decay D_ts = exp(G_t - G_s) on
  those pairs and A = strictly-lower(beta_t k_t.k_s D_ts), the chunk's pseudo-values are
  u = (I + A)^-1 (beta v) - (I + A)^-1 (beta exp(G) k) S_0 =: u0 - w S_0.

  Returns w, u0, the causal intra-chunk scores P_ts = q_t.k_s D_ts, q scaled by the decay
  since chunk start (zero after a reset), keys scaled by their decay to chunk end (zero if
  reset later in the chunk), and the decay of the carried-in state over the whole chunk.
  """
  dt = q.dtype
  c = q.shape[-2]
  lower = jnp.tril(jnp.ones((c, c), dt))
  # Running sums inside a chunk as one matmul with a lower-triangular ones matrix (XLA:CPU
  # lowers jnp.cumsum to reduce-window chains). HIGHEST: the log-decays must stay f32 exact
  # on backends whose default matmul precision rounds f32 inputs to bf16.
  big_g = jnp.einsum("nbhs,ts->nbht", g, lower, precision=jax.lax.Precision.HIGHEST)
  pair = lower.astype(bool)
  if reset is None:
    fresh = jnp.ones_like(big_g)
    to_end_mask, carried = fresh, jnp.ones_like(big_g[..., -1])
  else:
    # Reset counts are small integers, exact in f32.
    count = jnp.einsum("nbs,ts->nbt", reset.astype(dt), lower,
                       precision=jax.lax.Precision.HIGHEST)[:, :, None, :]  # [n, b, 1, c]
    pair = pair & (count[..., :, None] == count[..., None, :])  # [n, b, 1, t, s]
    fresh = (count == 0).astype(dt)  # token t still sees the carried-in state
    to_end_mask = (count == count[..., -1:]).astype(dt)
    carried = fresh[..., -1]
  # Mask the exponent, not the product: masked pairs (G_t - G_s > 0) could overflow exp.
  decay = jnp.exp(jnp.where(pair, big_g[..., :, None] - big_g[..., None, :], -jnp.inf))
  qk_kk = einsum("nbhtk,nbhsk->nbhts", jnp.concatenate([q, k], axis=-2), k, dt)
  scores = qk_kk[..., :c, :] * decay  # [n, b, h, t, s]
  a_mat = beta[..., :, None] * qk_kk[..., c:, :] * decay  # unit_lower_solve reads its strict lower part
  gamma = jnp.exp(big_g) * fresh  # [n, b, h, c]
  rhs = jnp.concatenate([k * (beta * gamma)[..., None], v * beta[..., None]], axis=-1)
  sol = unit_lower_solve(a_mat, rhs)
  kd = k.shape[-1]
  w, u0 = sol[..., :kd], sol[..., kd:]
  q_decayed = q * gamma[..., None]
  k_to_end = k * (jnp.exp(big_g[..., -1:] - big_g) * to_end_mask)[..., None]
  state_decay = jnp.exp(big_g[..., -1]) * carried  # [n, b, h]
  return w, u0, scores, q_decayed, k_to_end, state_decay


# Chunks handled per step of the sequential scan. Measured with experiments/bench/
# delta_chunked_vs_recurrent.py on XLA:CPU: 4 was the fastest of 1, 2, 4, 8 and 16 for
# forward + backward at 16K tokens; at 4K forward they were within noise of each other.
CHUNKS_PER_STEP = 4


def _group(x, groups: int, width: int, pad: int):
  """[b, t, ...] -> [groups, b, width, ...]: the time axis padded (zeros / False) and cut."""
  x = _pad_time(x, pad, False if x.dtype == bool else 0)
  return jnp.moveaxis(x.reshape((x.shape[0], groups, width) + x.shape[2:]), 1, 0)


@jax.named_scope(F32_SCOPE)
def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, reset=None, chunk_size: int = 64,
                           chunks_per_step: int = CHUNKS_PER_STEP):
  """Chunkwise-parallel (WY/UT) form for training and prefill.

  Same arguments and results as the reference `naive_gated_delta_rule`, plus `chunk_size`
  (tokens per chunk) and `chunks_per_step`. Any length works: the tail is padded with
  beta = 0, g = 0 tokens, which leave the state unchanged, and the padded outputs are sliced
  off.

  One lax.scan step takes `chunks_per_step` chunks: their intra-chunk work (_chunk_terms) as
  batched matmuls, then the [k, v] state through them in order. A step's intermediates are
  sized by chunks_per_step, not by the sequence, and are reused from step to step, where
  doing every chunk's intra-chunk work at once streamed ~60 MB of [chunks, ...]
  intermediates through memory per 4K tokens (small config's heads, batch 1). The backward
  recomputes a step from its carried-in state (jax.checkpoint on the step) rather than saving
  its intermediates: it keeps one [k, v] state per step, and was faster than saving them
  (the same benchmark, 16K tokens).
  """
  check_inputs("chunk_gated_delta_rule", q, k, v, g, beta, initial_state, reset)
  for name, value in (("chunk_size", chunk_size), ("chunks_per_step", chunks_per_step)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"chunk_gated_delta_rule: {name}={value!r} must be a positive int.")
  dt = jnp.float32
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  c = chunk_size
  per_step = min(chunks_per_step, max(1, math.ceil(t / c)))
  steps = max(1, math.ceil(t / (c * per_step)))
  width = per_step * c
  pad = steps * width - t
  xs = tuple(_group(x.astype(dt), steps, width, pad) for x in (q, k, v, g, beta))
  if reset is not None:
    xs = xs + (_group(reset, steps, width, pad),)

  # The state stays f32 whatever the compute dtype: it sums decayed rank-c updates over the
  # whole sequence, and each chunk reads it back through w (the UT transform's inverse).
  @jax.named_scope(F32_SCOPE)  # a scan body starts a fresh name stack
  def step(s, inp):
    chunks = tuple(_to_chunks(x, per_step, c) for x in inp)  # [per_step, b, h, c, ...]
    w, u0, scores, q_decayed, k_to_end, state_decay = _chunk_terms(
        *chunks[:5], chunks[5] if reset is not None else None)
    outs = []
    for j in range(per_step):
      u = u0[j] - einsum("bhck,bhkv->bhcv", w[j], s, dt)
      outs.append(einsum("bhtk,bhkv->bhtv", q_decayed[j], s, dt)
                  + einsum("bhts,bhsv->bhtv", scores[j], u, dt))
      s = state_decay[j][..., None, None] * s + einsum("bhck,bhcv->bhkv", k_to_end[j], u, dt)
    o = jnp.stack(outs, axis=1)  # [b, per_step, h, c, vd]
    return s, jnp.swapaxes(o, 2, 3).reshape(b, width, h, vd)

  s0 = initial_state_or_zeros(initial_state, b, h, kd, vd, dt)
  final, o = jax.lax.scan(jax.checkpoint(step, prevent_cse=False), s0, xs)
  o = jnp.moveaxis(o, 0, 1).reshape(b, steps * width, h, vd)[:, :t]
  return o.astype(v.dtype), final
