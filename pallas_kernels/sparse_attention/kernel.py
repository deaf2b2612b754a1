"""Pallas kernels for top-k sparse MQA over the MLA latent (DeepSeek-V3.2 DSA main attention).

Each query t attends to its own k selected key slots (DeepSeek-AI,
"DeepSeek-V3.2-Exp", 2025), in MQA form over the absorbed MLA latent
(DeepSeek-V2 sec. 2.1): one latent row and one RoPE key row per selected key
serve every head, so a kernel step gathers J rows once and runs [h, c] x
[c, J] matmuls for all heads. Work is laid out as

  grid (batch, query tiles of `bq`, head blocks of `hb`)
    for each query of the tile, for each block of J selected slots:
      gather the J latent / RoPE-key rows named by the indices,
      online softmax (flash-attention style, f32) over the slots.

Two backends, one maths. The gather and the key-gradient scatter are the
only backend-specific parts:

* TPU (Mosaic): indices are read as scalars from SMEM; each selected row is
  copied HBM -> VMEM by its own DMA into a double buffer (the next slot
  block is in flight while this one is computed). TensorCores have no
  atomic adds and Mosaic does not lower DMA-with-add, so the backward
  kernel writes the per-slot key-gradient rows and the caller scatter-adds
  them (ops.py, one query chunk at a time so the rows of only one chunk
  exist at once).
* GPU (Triton): rows are gathered with `ref[rows, :]` loads on computed
  indices, and the backward kernel scatter-adds key gradients with
  `atomic_add` into an f32 buffer. Invalid slots are sent to distinct
  dummy rows past the end (rows s..s+J-1) so that no two lanes of one
  atomic add name the same row (interpret mode applies an atomic add as a
  gather + set, which would lose duplicate updates).

Array layouts (prepared by ops.py; Tp, Kp padded to bq and J multiples):
  q_lat [b, Tp, H, c], q_rope [b, Tp, H, p], latent [b, s, c], k_rope [b, s, p]
  sel   [b, Tp, Kp] int32 key index per slot, -1 for an invalid slot;
  mask  [b, Tp, nJ, 1, J] the same indices blocked by slot block (vector loads
        only touch leading dims, which both Mosaic and Triton index freely).
  lse / dd [b, Tp, H, 1] f32 per-head log-sum-exp and rowsum(dO*O) - dlse.

Einsum legend: b batch, t query, s key, h heads, c latent dim, p RoPE dim,
j selected slot.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

_F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # a [m, k] . b [n, k] -> [m, n]
_TN = (((0,), (0,)), ((), ()))  # a [k, m] . b [k, n] -> [m, n]
_NN = (((1,), (0,)), ((), ()))


@dataclasses.dataclass(frozen=True)
class Geometry:
  """Static sizes of one call (all padded as the kernels see them)."""
  batch: int
  queries: int   # Tp, a multiple of block_q
  keys: int      # s, rows of latent / k_rope
  heads: int     # H as the kernel sees it (padded on Triton)
  real_heads: int
  latent: int    # c
  rope: int      # p
  slots: int     # Kp, a multiple of block_k
  block_q: int
  block_k: int   # J
  block_h: int
  scale: float
  backend: str   # "tpu" | "triton"
  # False: compile. True: the backend's interpreter (TPU: pltpu.InterpretParams(),
  # which simulates DMAs and NaN-fills fresh memory; Triton: generic). Or explicit params.
  interpret: bool | pltpu.InterpretParams

  @property
  def n_slot_blocks(self) -> int:
    return self.slots // self.block_k

  @property
  def grid(self) -> tuple[int, int, int]:
    return (self.batch, self.queries // self.block_q, self.heads // self.block_h)


# ---------------------------------------------------------------------------
# Row sources: how a block of J selected rows reaches the kernel.
# ---------------------------------------------------------------------------
class _DmaRows:
  """TPU: per-row DMAs HBM -> VMEM double buffer, indices from SMEM."""

  prefetch = True

  def __init__(self, sel_smem, lat_hbm, kr_hbm, glat, gkr, sems, block_k: int):
    self.sel, self.lat, self.kr, self.glat, self.gkr, self.sems = sel_smem, lat_hbm, kr_hbm, glat, gkr, sems
    self.block_k = block_k
    self.b = pl.program_id(0)

  def _copies(self, row, j, slot):
    lat = pltpu.make_async_copy(self.lat.at[self.b, pl.ds(row, 1)], self.glat.at[slot, pl.ds(j, 1)],
                                self.sems.at[slot, 0])
    kr = pltpu.make_async_copy(self.kr.at[self.b, pl.ds(row, 1)], self.gkr.at[slot, pl.ds(j, 1)],
                               self.sems.at[slot, 1])
    return lat, kr

  def start(self, qi, jb, slot):
    def one(j, carry):
      # Invalid slots (-1) fetch row 0: every buffer row then holds finite
      # data, and the mask zeroes its probability.
      row = jnp.maximum(self.sel[qi, jb * self.block_k + j], 0)
      for cp in self._copies(row, j, slot):
        cp.start()
      return carry
    lax.fori_loop(0, self.block_k, one, 0)

  def wait(self, slot):
    def one(j, carry):
      for cp in self._copies(0, j, slot):
        cp.wait()
      return carry
    lax.fori_loop(0, self.block_k, one, 0)

  def rows(self, qi, jb, slot):
    del qi, jb
    return self.glat[slot], self.gkr[slot]


class _LoadRows:
  """Triton: gathers rows with a vector load on computed indices."""

  prefetch = False

  def __init__(self, mask_ref, lat_ref, kr_ref):
    self.mask, self.lat, self.kr = mask_ref, lat_ref, kr_ref

  def rows(self, qi, jb, slot):
    del slot
    rows = jnp.maximum(self.mask[qi, jb, 0], 0)
    return self.lat[rows, :], self.kr[rows, :]


def _slot_loop(src, geo: Geometry, init, step, finish) -> None:
  """for qi in tile: carry = init(qi); for jb: carry = step(...); finish(qi, carry).

  With a prefetching source the rows of step k+1 are requested before
  step k waits for its own, across query boundaries too.
  """
  n_j = geo.n_slot_blocks
  total = geo.block_q * n_j
  if src.prefetch:
    src.start(0, 0, 0)

  def per_query(qi, carry0):
    def per_block(jb, carry):
      k = qi * n_j + jb
      slot = lax.rem(k, 2)  # lax.rem/div: jnp's floor semantics lower to sign ops
      if src.prefetch:
        nxt = k + 1

        @pl.when(nxt < total)
        def _():
          src.start(lax.div(nxt, n_j), lax.rem(nxt, n_j), 1 - slot)

        src.wait(slot)
      glat, gkr = src.rows(qi, jb, slot)
      return step(qi, jb, glat, gkr, carry)

    finish(qi, lax.fori_loop(0, n_j, per_block, init(qi)))
    return carry0

  lax.fori_loop(0, geo.block_q, per_query, 0)


# ---------------------------------------------------------------------------
# The maths of one (query, slot block) step, shared by both backends.
# ---------------------------------------------------------------------------
def _logits(q, qr, glat, gkr, scale: float):
  """[hb, c], [hb, p], [J, c], [J, p] -> scale * (q . lat + qr . k_rope) [hb, J] f32."""
  s = lax.dot_general(q, glat.astype(q.dtype), _NT, preferred_element_type=_F32)
  s = s + lax.dot_general(qr, gkr.astype(qr.dtype), _NT, preferred_element_type=_F32)
  return s * scale


def _forward_kernel(geo: Geometry, src_of, mask_ref, q_ref, qr_ref, out_ref, lse_ref):
  """Online softmax over the selected slots; out = sum_j p_j latent_j, lse per head."""
  src = src_of()
  hb, c = geo.block_h, geo.latent

  def init(qi):
    return (jnp.full((hb, 1), -jnp.inf, _F32), jnp.zeros((hb, 1), _F32), jnp.zeros((hb, c), _F32))

  def step(qi, jb, glat, gkr, carry):
    m, l, acc = carry
    valid = mask_ref[qi, jb] >= 0  # [1, J]
    s = _logits(q_ref[qi], qr_ref[qi], glat, gkr, geo.scale)
    m_new = jnp.maximum(m, jnp.max(jnp.where(valid, s, -jnp.inf), axis=1, keepdims=True))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no valid slot yet: keep exp finite
    alpha = jnp.exp(m - m_use)
    p = jnp.where(valid, jnp.exp(s - m_use), 0.0)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    pv = lax.dot_general(p.astype(q_ref.dtype), glat.astype(q_ref.dtype), _NN, preferred_element_type=_F32)
    return m_new, l, alpha * acc + pv

  def finish(qi, carry):
    m, l, acc = carry
    ok = l > 0
    safe_l = jnp.where(ok, l, 1.0)
    out_ref[qi] = jnp.where(ok, acc / safe_l, 0.0).astype(out_ref.dtype)
    lse_ref[qi] = jnp.where(ok, m + jnp.log(safe_l), -jnp.inf)

  _slot_loop(src, geo, init, step, finish)


def _probs_kernel(geo: Geometry, src_of, mask_ref, q_ref, qr_ref, lse_ref, p_ref):
  """Head-summed probabilities of each slot (this head block's share), from the final lse."""
  src = src_of()
  first_head = pl.program_id(2) * geo.block_h
  heads = first_head + lax.broadcasted_iota(jnp.int32, (geo.block_h, 1), 0)

  def step(qi, jb, glat, gkr, carry):
    valid = (mask_ref[qi, jb] >= 0) & (heads < geo.real_heads)  # padded heads carry no mass
    s = _logits(q_ref[qi], qr_ref[qi], glat, gkr, geo.scale)
    p = jnp.where(valid, jnp.exp(s - lse_ref[qi]), 0.0)
    p_ref[qi, jb] = jnp.sum(p, axis=0, keepdims=True) / geo.real_heads
    return carry

  _slot_loop(src, geo, lambda qi: 0, step, lambda qi, carry: None)


def _backward_kernel(geo: Geometry, src_of, sink, mask_ref, q_ref, qr_ref, do_ref, lse_ref, dd_ref,
                     dq_ref, dqr_ref):
  """dq accumulated per query; per-slot key gradients handed to `sink` (scatter or rows)."""
  src = src_of()
  hb, c, pr = geo.block_h, geo.latent, geo.rope
  dt = q_ref.dtype

  def init(qi):
    return jnp.zeros((hb, c), _F32), jnp.zeros((hb, pr), _F32)

  def step(qi, jb, glat, gkr, carry):
    dq, dqr = carry
    q, qr, do = q_ref[qi], qr_ref[qi], do_ref[qi]
    glat, gkr = glat.astype(dt), gkr.astype(dt)
    valid = mask_ref[qi, jb] >= 0
    s = _logits(q, qr, glat, gkr, geo.scale)
    p = jnp.where(valid, jnp.exp(s - lse_ref[qi]), 0.0)
    dp = lax.dot_general(do, glat, _NT, preferred_element_type=_F32)
    ds = (p * (dp - dd_ref[qi]) * geo.scale).astype(dt)  # d logit, scale folded in
    dq = dq + lax.dot_general(ds, glat, _NN, preferred_element_type=_F32)
    dqr = dqr + lax.dot_general(ds, gkr, _NN, preferred_element_type=_F32)
    dglat = (lax.dot_general(ds, q, _TN, preferred_element_type=_F32)
             + lax.dot_general(p.astype(dt), do, _TN, preferred_element_type=_F32))
    sink(qi, jb, dglat, lax.dot_general(ds, qr, _TN, preferred_element_type=_F32))
    return dq, dqr

  def finish(qi, carry):
    dq_ref[qi] = carry[0].astype(dq_ref.dtype)
    dqr_ref[qi] = carry[1].astype(dqr_ref.dtype)

  _slot_loop(src, geo, init, step, finish)


# ---------------------------------------------------------------------------
# pallas_call wiring per backend.
# ---------------------------------------------------------------------------
def _tpu_backward_body(geo: Geometry, src_of, mask_ref, *refs):
  """TPU backward: per-slot key-gradient rows streamed to HBM through a double-buffered stage.

  The rows of all slots of a query tile would not fit VMEM at model sizes
  (k=2048, c=512: 4 MiB per query in f32), so each slot block's rows are
  staged in VMEM and copied out by DMA while the next block is computed; a
  stage buffer is reused only after the copy issued two steps earlier is done.
  """
  *main, rows_l, rows_k, stage_l, stage_k, sems = refs
  n_j = geo.n_slot_blocks
  b, q0 = pl.program_id(0), pl.program_id(1) * geo.block_q

  def copies(qi, jb, slot):
    return (pltpu.make_async_copy(stage_l.at[slot], rows_l.at[b, q0 + qi, jb], sems.at[slot, 0]),
            pltpu.make_async_copy(stage_k.at[slot], rows_k.at[b, q0 + qi, jb], sems.at[slot, 1]))

  def wait(slot):
    for cp in copies(0, 0, slot):
      cp.wait()

  def sink(qi, jb, dglat, dgkr):
    k = qi * n_j + jb
    slot = lax.rem(k, 2)

    @pl.when(k >= 2)
    def _():
      wait(slot)

    stage_l[slot] = dglat
    stage_k[slot] = dgkr
    for cp in copies(qi, jb, slot):
      cp.start()

  _backward_kernel(geo, src_of, sink, mask_ref, *main)
  total = geo.block_q * n_j
  for k in range(max(0, total - 2), total):  # drain the last (up to two) copies
    wait(k % 2)


def _specs(geo: Geometry):
  """BlockSpecs shared by the kernels: mask, per-query [H] arrays, per-query row arrays."""
  bq, hb, n_j, j = geo.block_q, geo.block_h, geo.n_slot_blocks, geo.block_k
  mask = pl.BlockSpec((None, bq, n_j, 1, j), lambda b, i, h: (b, i, 0, 0, 0))

  def heads(last):  # [b, Tp, H, last] blocked by query tile and head block
    return pl.BlockSpec((None, bq, hb, last), lambda b, i, h: (b, i, h, 0))

  return mask, heads


def _compiler_params(geo: Geometry):
  if geo.interpret:
    return None
  if geo.backend == "tpu":
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"))
  return plgpu.CompilerParams(num_warps=4, num_stages=1)


def _interpret(geo: Geometry):
  if not geo.interpret:
    return False
  if isinstance(geo.interpret, pltpu.InterpretParams):
    return geo.interpret
  return pltpu.InterpretParams() if geo.backend == "tpu" else True


def _call(geo: Geometry, body, row_inputs, inputs, in_specs, out_shape, out_specs, extra_scratch=(), **kw):
  """pallas_call with the backend's row source prepended to `body`.

  row_inputs = (sel, mask, latent, k_rope); `body(src_of, mask_ref, *ins, *outs, *extra_scratch)`
  (extra scratch: TPU only).
  """
  sel, mask, latent, k_rope = row_inputs
  mask_spec, _ = _specs(geo)
  n_in, n_out = len(inputs), len(out_shape)
  if geo.backend == "tpu":
    def kernel(sel_ref, mask_ref, lat_ref, kr_ref, *refs):
      ins, outs = refs[:n_in], refs[n_in:n_in + n_out]
      glat, gkr, sems = refs[n_in + n_out:n_in + n_out + 3]
      src_of = lambda: _DmaRows(sel_ref, lat_ref, kr_ref, glat, gkr, sems, geo.block_k)
      body(src_of, mask_ref, *ins, *outs, *refs[n_in + n_out + 3:])

    row_specs = [pl.BlockSpec((None, geo.block_q, geo.slots), lambda b, i, h: (b, i, 0),
                              memory_space=pltpu.SMEM),
                 mask_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
    scratch = [pltpu.VMEM((2, geo.block_k, geo.latent), latent.dtype),
               pltpu.VMEM((2, geo.block_k, geo.rope), k_rope.dtype), pltpu.SemaphoreType.DMA((2, 2)),
               *extra_scratch]
    args = (sel, mask, latent, k_rope)
  else:
    def kernel(mask_ref, lat_ref, kr_ref, *refs):
      src_of = lambda: _LoadRows(mask_ref, lat_ref, kr_ref)
      body(src_of, mask_ref, *refs)

    s, c, p = geo.keys, geo.latent, geo.rope
    row_specs = [mask_spec, pl.BlockSpec((None, s, c), lambda b, i, h: (b, 0, 0)),
                 pl.BlockSpec((None, s, p), lambda b, i, h: (b, 0, 0))]
    scratch = []
    args = (mask, latent, k_rope)
  return pl.pallas_call(
      kernel, grid=geo.grid, in_specs=row_specs + list(in_specs), out_specs=out_specs,
      out_shape=out_shape, scratch_shapes=scratch, compiler_params=_compiler_params(geo),
      interpret=_interpret(geo), **kw)(*args, *inputs)


def forward(geo: Geometry, q_lat, q_rope, latent, k_rope, sel, mask):
  """-> out [b, Tp, H, c] (q_lat dtype), lse [b, Tp, H, 1] f32 (-inf for a row with no valid slot)."""
  _, heads = _specs(geo)
  b, tp, h = geo.batch, geo.queries, geo.heads
  out_shape = [jax.ShapeDtypeStruct((b, tp, h, geo.latent), q_lat.dtype),
               jax.ShapeDtypeStruct((b, tp, h, 1), _F32)]
  body = functools.partial(_forward_kernel, geo)
  return _call(geo, body, (sel, mask, latent, k_rope), (q_lat, q_rope),
               [heads(geo.latent), heads(geo.rope)], out_shape, [heads(geo.latent), heads(1)])


def probs(geo: Geometry, q_lat, q_rope, latent, k_rope, sel, mask, lse):
  """-> [b, nH, Tp, nJ, 1, J] f32: per head block, sum over its real heads of p / real_heads."""
  _, heads = _specs(geo)
  b, tp, n_h, n_j, j = geo.batch, geo.queries, geo.grid[2], geo.n_slot_blocks, geo.block_k
  out_shape = [jax.ShapeDtypeStruct((b, n_h, tp, n_j, 1, j), _F32)]
  out_spec = pl.BlockSpec((None, None, geo.block_q, n_j, 1, j), lambda b, i, h: (b, h, i, 0, 0, 0))
  body = functools.partial(_probs_kernel, geo)
  (p,) = _call(geo, body, (sel, mask, latent, k_rope), (q_lat, q_rope, lse),
               [heads(geo.latent), heads(geo.rope), heads(1)], out_shape, [out_spec])
  return p


def backward(geo: Geometry, q_lat, q_rope, latent, k_rope, sel, mask, do, lse, dd):
  """Gradients of the forward kernel's out (and lse, folded into dd).

  Returns dq_lat, dq_rope (q dtypes) and, on Triton, dlatent [b, s, c] and
  dk_rope [b, s, p] f32 (scatter-added in the kernel); on TPU the per-slot rows
  dlat_rows [b, Tp, nJ, J, c] and dkr_rows [b, Tp, nJ, J, p] f32 (written to
  HBM by DMA) for the caller to scatter-add at sel.
  """
  _, heads = _specs(geo)
  b, tp, h, s, c, p = geo.batch, geo.queries, geo.heads, geo.keys, geo.latent, geo.rope
  ins = (q_lat, q_rope, do, lse, dd)
  in_specs = [heads(c), heads(p), heads(c), heads(1), heads(1)]
  dq_shapes = [jax.ShapeDtypeStruct((b, tp, h, c), q_lat.dtype),
               jax.ShapeDtypeStruct((b, tp, h, p), q_rope.dtype)]
  dq_specs = [heads(c), heads(p)]
  n_j, j = geo.n_slot_blocks, geo.block_k
  if geo.backend == "tpu":
    if geo.grid[2] != 1:
      raise ValueError("sparse attention backward (TPU): the per-slot key-gradient rows need all heads "
                       "in one block; use BlockSizes(block_h=None).")
    out_shape = dq_shapes + [jax.ShapeDtypeStruct((b, tp, n_j, j, c), _F32),
                             jax.ShapeDtypeStruct((b, tp, n_j, j, p), _F32)]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    stage = [pltpu.VMEM((2, j, c), _F32), pltpu.VMEM((2, j, p), _F32), pltpu.SemaphoreType.DMA((2, 2))]
    body = functools.partial(_tpu_backward_body, geo)
    return _call(geo, body, (sel, mask, latent, k_rope), ins, in_specs, out_shape,
                 dq_specs + [any_spec, any_spec], extra_scratch=stage)

  def body(src_of, mask_ref, *refs):  # Triton: atomic scatter-add into f32 accumulators
    n = len(ins)  # refs: ins, the two aliased accumulator inputs, dq, dq_rope, dlat, dk_rope
    main, (dl_ref, dk_ref) = refs[:n] + refs[n + 2:n + 4], refs[n + 4:]
    dummy = s + lax.broadcasted_iota(jnp.int32, (j,), 0)

    def sink(qi, jb, dglat, dgkr):
      sel_row = mask_ref[qi, jb, 0]
      dst = jnp.where(sel_row >= 0, sel_row, dummy)[:, None]
      plgpu.atomic_add(dl_ref, (dst, lax.broadcasted_iota(jnp.int32, (1, c), 1)), dglat)
      plgpu.atomic_add(dk_ref, (dst, lax.broadcasted_iota(jnp.int32, (1, p), 1)), dgkr)

    _backward_kernel(geo, src_of, sink, mask_ref, *main)

  acc = lambda last: pl.BlockSpec((None, s + j, last), lambda b, i, h: (b, 0, 0))
  zeros = (jnp.zeros((b, s + j, c), _F32), jnp.zeros((b, s + j, p), _F32))
  out_shape = dq_shapes + [jax.ShapeDtypeStruct(z.shape, _F32) for z in zeros]
  n_before = 3 + len(ins)  # mask, latent, k_rope, then ins
  dq_lat, dq_rope, dlat, dkr = _call(
      geo, body, (sel, mask, latent, k_rope), ins + zeros, in_specs + [acc(c), acc(p)], out_shape,
      dq_specs + [acc(c), acc(p)], input_output_aliases={n_before: 2, n_before + 1: 3})
  return dq_lat, dq_rope, dlat[:, :s], dkr[:, :s]
