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

All maths runs in float32 whatever the input dtype (the decay is an exponent summed over the
sequence); outputs come back in v's dtype and states in float32.

Einsum legend: b batch, n chunk index, t query position (in a chunk), s key position (in a
chunk), r a third in-chunk position (matrix products in the triangular inverse), h heads,
k key dim, v value dim, x k and v dims side by side.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from model.layers import einsum
from pallas_kernels.delta_rule.reference import check_inputs, initial_state_or_zeros

# Diagonal blocks up to this size are inverted by forward substitution; larger ones are
# split in halves and merged with matmuls.
_SUBSTITUTION_BLOCK = 16


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


def _forward_substitution_inverse(a):
  """(I + a)^-1 for strictly lower-triangular a [..., m, m], one row per loop step.

  Row i of T = (I + a)^-1 is e_i - a[i] T: a[i] only reaches rows j < i, which are final.
  """
  m = a.shape[-1]
  eye = jnp.eye(m, dtype=a.dtype)

  def row(i, t):
    a_i = jax.lax.dynamic_index_in_dim(a, i, axis=-2, keepdims=False)  # [..., m]
    new = eye[i] - einsum("...s,...sr->...r", a_i, t, a.dtype)
    return jax.lax.dynamic_update_index_in_dim(t, new, i, axis=-2)

  return jax.lax.fori_loop(1, m, row, jnp.broadcast_to(eye, a.shape))


def _blocked_inverse(a):
  """(I + a)^-1 by halving: [[T11, 0], [-T22 a21 T11, T22]], both halves in one batch."""
  m = a.shape[-1]
  if m <= _SUBSTITUTION_BLOCK or m % 2:
    return _forward_substitution_inverse(a)
  h = m // 2
  diag = _blocked_inverse(jnp.stack([a[..., :h, :h], a[..., h:, h:]]))
  t11, t22 = diag[0], diag[1]
  a21_t11 = einsum("...ts,...sr->...tr", a[..., h:, :h], t11, a.dtype)
  t21 = -einsum("...ts,...sr->...tr", t22, a21_t11, a.dtype)
  top = jnp.concatenate([t11, jnp.zeros_like(t11)], axis=-1)
  return jnp.concatenate([top, jnp.concatenate([t21, t22], axis=-1)], axis=-2)


@jax.custom_vjp
def unit_lower_inverse(a):
  """(I + a)^-1 for a [..., m, m] whose strictly lower triangle is used (the rest is ignored).

  Matmuls and a short substitution loop instead of jax.scipy.linalg.solve_triangular: its
  batched LAPACK trsm on XLA:CPU (jaxlib 0.10) hung in our forward+backward benchmark
  (ParallelBatchMap waiting on the XLA thread pool), and matmuls are what accelerators are
  good at. The VJP is analytic (dT = -T da T), so the loop is never
  differentiated and stores no per-step residuals.
  """
  return _blocked_inverse(jnp.tril(a, -1))


def _unit_lower_inverse_fwd(a):
  t = _blocked_inverse(jnp.tril(a, -1))
  return t, t


def _unit_lower_inverse_bwd(t, ct):
  dt = t.dtype
  tt = jnp.swapaxes(t, -1, -2)
  grad = -einsum("...ts,...sr->...tr", einsum("...ts,...sr->...tr", tt, ct, dt), tt, dt)
  return (jnp.tril(grad, -1),)


unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


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
  reset [n, b, c]. Within a chunk, G_t = sum_{s<=t} g_s, and tokens t, s interact iff no
  reset lies in (s, t] (equal running reset count). With decay D_ts = exp(G_t - G_s) on
  those pairs and A = strictly-lower(beta_t k_t.k_s D_ts), the chunk's pseudo-values are
  u = (I + A)^-1 (beta v) - (I + A)^-1 (beta exp(G) k) S_0 =: u0 - w S_0.

  Returns w, u0, the causal intra-chunk scores P_ts = q_t.k_s D_ts, q scaled by the decay
  since chunk start (zero after a reset), keys scaled by their decay to chunk end (zero if
  reset later in the chunk), and the decay of the carried-in state over the whole chunk.
  """
  dt = q.dtype
  c = q.shape[-2]
  big_g = jnp.cumsum(g, axis=-1)  # [n, b, h, c]
  count = jnp.cumsum(reset.astype(jnp.int32), axis=-1)[:, :, None, :]  # [n, b, 1, c]
  same = count[..., :, None] == count[..., None, :]  # [n, b, 1, t, s]
  causal = jnp.tril(jnp.ones((c, c), bool))
  pair = same & causal
  # Mask the exponent, not the product: masked pairs (G_t - G_s > 0) could overflow exp.
  decay = jnp.exp(jnp.where(pair, big_g[..., :, None] - big_g[..., None, :], -jnp.inf))
  qk_kk = einsum("nbhtk,nbhsk->nbhts", jnp.concatenate([q, k], axis=-2), k, dt)
  scores = qk_kk[..., :c, :] * decay  # [n, b, h, t, s]
  strict = pair & ~jnp.eye(c, dtype=bool)
  a_mat = jnp.where(strict, beta[..., :, None] * qk_kk[..., c:, :] * decay, 0.0)
  fresh = (count == 0).astype(dt)  # token t still sees the carried-in state
  gamma = jnp.exp(big_g) * fresh  # [n, b, h, c]
  rhs = jnp.concatenate([k * (beta * gamma)[..., None], v * beta[..., None]], axis=-1)
  sol = einsum("nbhts,nbhsx->nbhtx", unit_lower_inverse(a_mat), rhs, dt)
  kd = k.shape[-1]
  w, u0 = sol[..., :kd], sol[..., kd:]
  q_decayed = q * gamma[..., None]
  last = count[..., -1:]
  to_end = jnp.where(count == last, jnp.exp(big_g[..., -1:] - big_g), 0.0)  # [n, b, h, c]
  k_to_end = k * to_end[..., None]
  state_decay = jnp.exp(big_g[..., -1]) * (last[..., 0] == 0).astype(dt)  # [n, b, h]
  return w, u0, scores, q_decayed, k_to_end, state_decay


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, reset=None, chunk_size: int = 64):
  """Chunkwise-parallel (WY/UT) form for training and prefill.

  Same arguments and results as the reference `naive_gated_delta_rule`, plus `chunk_size`
  (tokens per chunk). Any length works: the tail is padded with beta = 0, g = 0 tokens, which
  leave the state unchanged, and the padded outputs are sliced off.
  """
  check_inputs("chunk_gated_delta_rule", q, k, v, g, beta, initial_state, reset)
  if not isinstance(chunk_size, int) or chunk_size < 1:
    raise ValueError(f"chunk_gated_delta_rule: chunk_size={chunk_size!r} must be a positive int.")
  dt = jnp.float32
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  c = chunk_size
  n = max(1, math.ceil(t / c))
  pad = n * c - t
  if reset is None:
    reset = jnp.zeros((b, t), bool)
  q, k, v, g, beta = (_to_chunks(_pad_time(x.astype(dt), pad), n, c) for x in (q, k, v, g, beta))
  reset = _to_chunks(_pad_time(reset, pad, False), n, c)
  w, u0, scores, q_decayed, k_to_end, state_decay = _chunk_terms(q, k, v, g, beta, reset)

  def step(s, inp):
    w_n, u0_n, k_end_n, decay_n = inp
    u = u0_n - einsum("bhck,bhkv->bhcv", w_n, s, dt)
    s_next = decay_n[..., None, None] * s + einsum("bhck,bhcv->bhkv", k_end_n, u, dt)
    return s_next, (s, u)

  s0 = initial_state_or_zeros(initial_state, b, h, kd, vd, dt)
  final, (starts, u) = jax.lax.scan(step, s0, (w, u0, k_to_end, state_decay))
  o = (einsum("nbhtk,nbhkv->nbhtv", q_decayed, starts, dt)
       + einsum("nbhts,nbhsv->nbhtv", scores, u, dt))  # [n, b, h, c, vd]
  o = jnp.moveaxis(o, 0, 2).reshape(b, h, n * c, vd)[:, :, :t]
  return jnp.swapaxes(o, 1, 2).astype(v.dtype), final
