"""Pallas kernels for the chunkwise (WY/UT) gated delta rule: forward and backward.

Gated DeltaNet (Yang, Kautz & Hatamizadeh, ICLR 2025) in the chunkwise-parallel form of
DeltaNet (Yang et al., NeurIPS 2024): inside a chunk of c tokens all work is matmuls plus one
unit-lower-triangular inverse (the UT transform), and only the [kd, vd] state crosses chunk
boundaries. The maths is model/attention/delta_rule.py:chunk_gated_delta_rule, per chunk:

  D_ts  = exp(G_t - G_s) on causal same-segment pairs (G = in-chunk cumulative log decay)
  A     = strictly-lower(beta_t k_t.k_s D_ts),  T = (I + A)^-1
  w     = T (beta gamma k),  u0 = T (beta v),  u = u0 - w S      (gamma_t = exp(G_t), 0 after a reset)
  o     = (gamma q) S + (q k^T * D) u
  S'    = delta S + (e k)^T u                   (e_t: decay to chunk end, delta: of the whole chunk)

One program per (batch, head) owns the state: the forward kernel walks the chunks in order,
carrying S in registers / VMEM, and returns o and the final state (and, for the backward, the
state at each chunk start). The backward kernel walks the chunks in reverse, carrying dS, and
recomputes each chunk's intra-chunk terms (A, T, w, u) from the recomputed chunk-start states
instead of storing them, giving dq, dk, dv, dG, dbeta and d initial_state. dG is the gradient of
the in-chunk cumulative decay; the caller maps it back to dg (the adjoint of the cumsum).

Why the pieces look the way they do:
  * The inverse is forward substitution, one row per step, with masked full-matrix ops. It is
    stable (unlike the Neumann product (I - A)(I + A^2)..., whose powers of A grow like binomial
    coefficients when keys repeat), and it needs neither value slicing (Triton has none) nor
    dynamic row indexing of a value.
  * Per-token scalars (G, beta, segment counters) arrive as [n, 1, c] rows (a leading chunk axis,
    so a time block may hold any number of chunks under TPU tiling); their column forms are
    made in-kernel by a masked lane reduction with the identity, so no in-kernel transpose of a
    vector is needed on either backend.
  * Grid (b, h, time blocks): the time axis is sequential ("arbitrary" on TPU) and the state is
    carried between its steps in the final-state output block, which stays resident because its
    block index does not change along that axis. On the GPU (Triton backend, whose grid is fully
    parallel) there is exactly one time block.
  * f32 throughout with HIGHEST matmul precision (Triton would otherwise use TF32).

Shapes (all f32; head dims may be padded by the caller): q, k [b, h, T, K], v [b, h, T, V],
G, beta [b, h, n, 1, c], seg [b, n, 1, c], states [b, h, K, V], chunk states [b, h, n, K, V], T = n c.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

_HI = lax.Precision.HIGHEST
BACKENDS = ("interpret", "tpu", "triton")


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static launch configuration of one kernel call.

  chunk: tokens per chunk (c). time_block: tokens per grid step along time (a multiple of
  chunk dividing the padded length). backend: "interpret", "tpu" (Mosaic) or "triton".
  num_warps, num_stages: Triton launch parameters (ignored elsewhere).
  """
  chunk: int
  time_block: int
  backend: str
  num_warps: int = 4
  num_stages: int = 1


# ---- small in-kernel helpers -------------------------------------------------------------

def _mm(a, b):
  """a @ b in f32."""
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_HI,
                         preferred_element_type=jnp.float32)


def _mm_t(a, b):
  """a @ b^T in f32."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HI,
                         preferred_element_type=jnp.float32)


def _t_mm(a, b):
  """a^T @ b in f32."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_HI,
                         preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Masks:
  """Index masks of a c x c chunk (built once per program)."""
  rows: jax.Array  # [c, c] int32, t index
  cols: jax.Array  # [c, c] int32, s index
  lane: jax.Array  # [1, c] int32
  c: int

  @classmethod
  def make(cls, c: int) -> _Masks:
    return cls(lax.broadcasted_iota(jnp.int32, (c, c), 0), lax.broadcasted_iota(jnp.int32, (c, c), 1),
               lax.broadcasted_iota(jnp.int32, (1, c), 1), c)

  def col(self, row):
    """[1, c] -> [c, 1] (a masked lane reduction, no transpose)."""
    return jnp.sum(jnp.where(self.rows == self.cols, row, 0.0), axis=1, keepdims=True)

  def row(self, col):
    """[c, 1] -> [1, c]."""
    return jnp.sum(jnp.where(self.rows == self.cols, col, 0.0), axis=0, keepdims=True)


def _masked_exp(mask, x):
  """exp(x) where mask else 0, never evaluating exp on the masked-out (possibly large) x."""
  return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def _unit_lower_inverse(a_t, m: _Masks):
  """T = (I + A)^-1 given A^T (A strictly lower), by forward substitution.

  Row i of T is e_i - sum_s A[i, s] T[s]; A[i, s] is column i of A^T, and rows s < i of T are
  final when row i is formed.
  """
  eye = (m.rows == m.cols).astype(jnp.float32)

  def step(i, t):
    a_i = jnp.sum(jnp.where(m.cols == i, a_t, 0.0), axis=1, keepdims=True)  # [c, 1]: A[i, s]
    new = jnp.where(m.lane == i, 1.0, 0.0) - jnp.sum(a_i * t, axis=0, keepdims=True)  # [1, c]
    return jnp.where(m.rows == i, new, t)

  return lax.fori_loop(1, m.c, step, eye)


@dataclasses.dataclass(frozen=True)
class _Chunk:
  """The state-independent terms of one chunk."""
  decay: jax.Array      # [c, c] D_ts (zero off causal same-segment pairs)
  kk: jax.Array         # [c, c] k k^T
  qk: jax.Array         # [c, c] q k^T
  tinv: jax.Array       # [c, c] T = (I + A)^-1
  beta: jax.Array       # [c, 1]
  gamma: jax.Array      # [c, 1] exp(G_t), zero after a reset in the chunk
  to_end: jax.Array     # [c, 1] exp(G_last - G_t), zero if a reset follows t in the chunk
  state_decay: jax.Array  # [1, 1] exp(G_last), zero if the chunk holds a reset
  rhs_k: jax.Array      # [c, K] beta gamma k
  rhs_v: jax.Array      # [c, V] beta v


def _chunk_terms(q, k, v, g_row, beta_row, seg_row, m: _Masks) -> _Chunk:
  """Everything about a chunk that does not depend on the carried-in state."""
  g_col, beta_col, seg_col = m.col(g_row), m.col(beta_row), m.col(seg_row)
  same = seg_col == seg_row
  pair = same & (m.cols <= m.rows)
  pair_t = same & (m.rows <= m.cols)
  diff = g_col - g_row  # G_t - G_s
  decay = _masked_exp(pair, diff)
  kk = _mm_t(k, k)
  # A^T_ts = A_st = beta_s kk_ts D_st (kk is symmetric), strictly upper.
  a_t = jnp.where(m.rows < m.cols, beta_row * kk * _masked_exp(pair_t, -diff), 0.0)
  tinv = _unit_lower_inverse(a_t, m)
  is_last = m.lane == m.c - 1
  g_last = jnp.sum(jnp.where(is_last, g_row, 0.0), axis=1, keepdims=True)  # [1, 1]
  seg_last = jnp.sum(jnp.where(is_last, seg_row, 0.0), axis=1, keepdims=True)
  gamma = _masked_exp(seg_col == 0.0, g_col)
  to_end = _masked_exp(seg_col == seg_last, g_last - g_col)
  state_decay = _masked_exp(seg_last == 0.0, g_last)
  return _Chunk(decay=decay, kk=kk, qk=_mm_t(q, k), tinv=tinv, beta=beta_col, gamma=gamma,
                to_end=to_end, state_decay=state_decay, rhs_k=k * (beta_col * gamma),
                rhs_v=v * beta_col)


def _chunk_forward(q, k, ch: _Chunk, s):
  """o [c, V] and the next state [K, V] of one chunk, from the chunk-start state s."""
  w = _mm(ch.tinv, ch.rhs_k)
  u = _mm(ch.tinv, ch.rhs_v) - _mm(w, s)
  o = _mm(q * ch.gamma, s) + _mm(ch.qk * ch.decay, u)
  s_next = ch.state_decay * s + _t_mm(k * ch.to_end, u)
  return o, s_next


def _load_chunk(refs, i, c):
  """Chunk i of this program's block: q, k, v [c, *] and G, beta, seg rows [1, c]."""
  q_ref, k_ref, v_ref, g_ref, beta_ref, seg_ref = refs
  t = pl.ds(pl.multiple_of(i * c, c), c)
  return q_ref[t, :], k_ref[t, :], v_ref[t, :], g_ref[i], beta_ref[i], seg_ref[i]


# ---- forward -------------------------------------------------------------------------------

def _forward_kernel(*refs, chunk: int, chunks: int, time_blocks: int, emit_states: bool):
  """One (batch, head, time block) step: chunks in order, state carried in final_ref."""
  in_refs, s0_ref = refs[:6], refs[6]
  if emit_states:
    states_ref, final_ref = refs[7:]
  else:
    o_ref, final_ref = refs[7:]
  m = _Masks.make(chunk)
  if time_blocks == 1:
    s = s0_ref[...]
  else:
    j = pl.program_id(2)
    s = jnp.where(j == 0, s0_ref[...], final_ref[...])  # not read back before the first write

  def body(i, s):
    q, k, v, g_row, beta_row, seg_row = _load_chunk(in_refs, i, chunk)
    ch = _chunk_terms(q, k, v, g_row, beta_row, seg_row, m)
    o, s_next = _chunk_forward(q, k, ch, s)
    if emit_states:
      states_ref[i] = s
    else:
      o_ref[pl.ds(pl.multiple_of(i * chunk, chunk), chunk), :] = o
    return s_next

  final_ref[...] = lax.fori_loop(0, chunks, body, s)


def _specs(b, h, n, kd, vd, layout: Layout, reverse: bool):
  """BlockSpecs keyed by array kind, for grid (b, h, time blocks) walked forward or in reverse."""
  tb, c = layout.time_block, layout.chunk
  cpb = tb // c
  nt = n // cpb

  def tj(j):
    return nt - 1 - j if reverse else j

  return {
      "tk": pl.BlockSpec((None, None, tb, kd), lambda bi, hi, j: (bi, hi, tj(j), 0)),
      "tv": pl.BlockSpec((None, None, tb, vd), lambda bi, hi, j: (bi, hi, tj(j), 0)),
      "row": pl.BlockSpec((None, None, cpb, 1, c), lambda bi, hi, j: (bi, hi, tj(j), 0, 0)),
      "seg": pl.BlockSpec((None, cpb, 1, c), lambda bi, hi, j: (bi, tj(j), 0, 0)),
      "state": pl.BlockSpec((None, None, kd, vd), lambda bi, hi, j: (bi, hi, 0, 0)),
      "states": pl.BlockSpec((None, None, cpb, kd, vd), lambda bi, hi, j: (bi, hi, tj(j), 0, 0)),
  }, (b, h, nt)


def _call_params(layout: Layout) -> dict:
  if layout.backend == "interpret":
    return {"interpret": True}
  if layout.backend == "tpu":
    return {"compiler_params": pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "arbitrary"))}
  if layout.backend == "triton":
    return {"compiler_params": pltriton.CompilerParams(num_warps=layout.num_warps,
                                                       num_stages=layout.num_stages)}
  raise ValueError(f"Layout.backend={layout.backend!r}; expected one of {BACKENDS}.")


def _check_layout(q, v, g, layout: Layout) -> tuple[int, int, int, int, int]:
  b, h, tp, kd = q.shape
  n, c = g.shape[2], g.shape[-1]
  if g.shape[2:] != (n, 1, layout.chunk) or n * c != tp:
    raise ValueError(f"delta_rule kernel: g has shape {g.shape}; expected [b, h, {tp // layout.chunk}, 1, "
                     f"{layout.chunk}] for q of length {tp} and chunk {layout.chunk}.")
  if layout.time_block % c or tp % layout.time_block:
    raise ValueError(f"delta_rule kernel: time_block={layout.time_block} must be a multiple of the "
                     f"chunk ({c}) that divides the padded length {tp}.")
  if layout.backend == "triton" and layout.time_block != tp:
    raise ValueError("delta_rule kernel: the Triton grid is parallel, so time_block must be the "
                     f"whole padded length {tp}; got {layout.time_block}.")
  return b, h, n, kd, v.shape[-1]


def forward(q, k, v, g, beta, seg, s0, layout: Layout, *, emit_states: bool = False):
  """Runs the forward kernel.

  Args:
    q, k: [b, h, T, K]; v: [b, h, T, V]; g (in-chunk cumulative log decay), beta: [b, h, n, 1, c];
    seg: [b, n, 1, c] resets seen so far in the chunk (float); s0: [b, h, K, V]. All float32.
    layout: launch configuration.
    emit_states: return the chunk-start states instead of the outputs (for the backward).

  Returns:
    (o [b, h, T, V], final [b, h, K, V]) or, with emit_states, (states [b, h, n, K, V], final).
  """
  b, h, n, kd, vd = _check_layout(q, v, g, layout)
  spec, grid = _specs(b, h, n, kd, vd, layout, reverse=False)
  f32 = jnp.float32
  if emit_states:
    out_shape = (jax.ShapeDtypeStruct((b, h, n, kd, vd), f32), jax.ShapeDtypeStruct((b, h, kd, vd), f32))
    out_specs = (spec["states"], spec["state"])
  else:
    out_shape = (jax.ShapeDtypeStruct(v.shape, f32), jax.ShapeDtypeStruct((b, h, kd, vd), f32))
    out_specs = (spec["tv"], spec["state"])
  kernel = functools.partial(_forward_kernel, chunk=layout.chunk,
                             chunks=layout.time_block // layout.chunk, time_blocks=grid[2],
                             emit_states=emit_states)
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=grid,
      in_specs=[spec["tk"], spec["tk"], spec["tv"], spec["row"], spec["row"], spec["seg"],
                spec["state"]],
      out_specs=out_specs, name="gated_delta_rule_fwd", **_call_params(layout),
  )(q, k, v, g, beta, seg, s0)


# ---- backward ------------------------------------------------------------------------------

def _chunk_backward(q, k, v, ch: _Chunk, s, ds_next, do, m: _Masks):
  """Gradients of one chunk given its start state s, dS of its end state and dO.

  Returns dq, dk [c, K], dv [c, V], dG, dbeta [1, c] and dS of the chunk-start state [K, V].
  """
  w = _mm(ch.tinv, ch.rhs_k)
  u = _mm(ch.tinv, ch.rhs_v) - _mm(w, s)
  scores = ch.qk * ch.decay
  k_end = k * ch.to_end
  q_g = q * ch.gamma
  # S' = delta S + (e k)^T u;  o = (gamma q) S + scores u;  u = u0 - w S.
  du = _mm(k_end, ds_next) + _t_mm(scores, do)
  dk_end = _mm_t(u, ds_next)
  d_state_decay = jnp.sum(jnp.sum(s * ds_next, axis=1, keepdims=True), axis=0, keepdims=True)
  dq_g = _mm_t(do, s)
  dscores = _mm_t(do, u)
  ds = ch.state_decay * ds_next + _t_mm(q_g, do) - _t_mm(w, du)
  dw = -_mm_t(du, s)
  # w = T rhs_k, u0 = T rhs_v, T = (I + A)^-1: dA = -T^T dT T^T on the strict lower triangle.
  dtinv = _mm_t(du, ch.rhs_v) + _mm_t(dw, ch.rhs_k)
  drhs_v = _t_mm(ch.tinv, du)
  drhs_k = _t_mm(ch.tinv, dw)
  da = jnp.where(m.cols < m.rows, -_mm_t(_t_mm(ch.tinv, dtinv), ch.tinv), 0.0)
  # A = beta_t kk D, scores = qk D, D = exp(G_t - G_s) on pairs.
  dbeta = jnp.sum(da * ch.kk * ch.decay, axis=1, keepdims=True)
  dkk = da * ch.beta * ch.decay
  z = (da * ch.beta * ch.kk + dscores * ch.qk) * ch.decay
  dqk = dscores * ch.decay
  dq = _mm(dqk, k) + dq_g * ch.gamma
  dk = (_t_mm(dqk, q) + _mm(dkk, k) + _t_mm(dkk, k) + drhs_k * (ch.beta * ch.gamma)
        + dk_end * ch.to_end)
  dv = drhs_v * ch.beta
  drk_k = jnp.sum(drhs_k * k, axis=1, keepdims=True)
  dbeta = dbeta + jnp.sum(drhs_v * v, axis=1, keepdims=True) + drk_k * ch.gamma
  dgamma = drk_k * ch.beta + jnp.sum(dq_g * q, axis=1, keepdims=True)
  dend = jnp.sum(dk_end * k, axis=1, keepdims=True) * ch.to_end  # d(to_end) * to_end
  dg_col = jnp.sum(z, axis=1, keepdims=True) + dgamma * ch.gamma - dend
  d_last = jnp.sum(dend, axis=0, keepdims=True) + d_state_decay * ch.state_decay  # [1, 1]
  dg = m.row(dg_col) - jnp.sum(z, axis=0, keepdims=True) + jnp.where(m.lane == m.c - 1, d_last, 0.0)
  return dq, dk, dv, dg, m.row(dbeta), ds


def _backward_kernel(*refs, chunk: int, chunks: int, time_blocks: int):
  """One (batch, head, time block) step of the reverse pass; dS carried in ds0_ref."""
  in_refs = refs[:6]
  states_ref, do_ref, dfinal_ref = refs[6:9]
  dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, ds0_ref = refs[9:]
  m = _Masks.make(chunk)
  if time_blocks == 1:
    ds = dfinal_ref[...]
  else:
    j = pl.program_id(2)
    ds = jnp.where(j == 0, dfinal_ref[...], ds0_ref[...])  # not read back before the first write

  def body(r, ds):
    i = chunks - 1 - r
    q, k, v, g_row, beta_row, seg_row = _load_chunk(in_refs, i, chunk)
    ch = _chunk_terms(q, k, v, g_row, beta_row, seg_row, m)
    t = pl.ds(pl.multiple_of(i * chunk, chunk), chunk)
    dq, dk, dv, dg, dbeta, ds_prev = _chunk_backward(q, k, v, ch, states_ref[i], ds, do_ref[t, :], m)
    dq_ref[t, :] = dq
    dk_ref[t, :] = dk
    dv_ref[t, :] = dv
    dg_ref[i] = dg
    dbeta_ref[i] = dbeta
    return ds_prev

  ds0_ref[...] = lax.fori_loop(0, chunks, body, ds)


def backward(q, k, v, g, beta, seg, states, do, dfinal, layout: Layout):
  """Runs the reverse-pass kernel.

  Args:
    q, k, v, g, beta, seg: as for `forward`.
    states: [b, h, n, K, V] chunk-start states (forward(..., emit_states=True)).
    do: [b, h, T, V] output cotangent; dfinal: [b, h, K, V] final-state cotangent.
    layout: launch configuration.

  Returns:
    dq, dk [b, h, T, K], dv [b, h, T, V], dg, dbeta [b, h, n, 1, c], ds0 [b, h, K, V]; dg is the
    gradient of the in-chunk cumulative log decay.
  """
  b, h, n, kd, vd = _check_layout(q, v, g, layout)
  spec, grid = _specs(b, h, n, kd, vd, layout, reverse=True)
  f32 = jnp.float32
  out_shape = tuple(jax.ShapeDtypeStruct(x.shape, f32) for x in (q, k, v, g, beta)) + (
      jax.ShapeDtypeStruct((b, h, kd, vd), f32),)
  kernel = functools.partial(_backward_kernel, chunk=layout.chunk,
                             chunks=layout.time_block // layout.chunk, time_blocks=grid[2])
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=grid,
      in_specs=[spec["tk"], spec["tk"], spec["tv"], spec["row"], spec["row"], spec["seg"],
                spec["states"], spec["tv"], spec["state"]],
      out_specs=(spec["tk"], spec["tk"], spec["tv"], spec["row"], spec["row"], spec["state"]),
      name="gated_delta_rule_bwd", **_call_params(layout),
  )(q, k, v, g, beta, seg, states, do, dfinal)
