"""Pallas kernels: activations x MXFP4 weights, dequantized tile by tile in the kernel.

One grouped ("ragged") matmul serves both public ops (a dense matmul is one
group of all rows). Rows of x are sorted by group; group g owns rows
[bounds[g], bounds[g+1]) and multiplies them by its weight W_g [N, K], stored
as gpt-oss MXFP4 codes [G, N, K/2] (the [.., K/32, 16] blocks, reshaped for
free) and E8M0 scales. Rows past the last group give zeros, as lax.ragged_dot;
group bounds are clamped to M, so sizes summing past M address no row beyond x.

Nibble order without an in-kernel interleave: byte i of a block holds element
2i (low nibble) and 2i + 1 (high nibble), so with x split by parity,
x W^T = x_even lo^T + x_odd hi^T, where lo / hi are the [N, K/2] planes of low
and high nibbles. The wrapper (ops.py) passes x as xp [2, M, K/2] = (x_even,
x_odd) -- one cheap XLA transpose of the activations -- and the kernels never
shuffle lanes. Inside a tile the codes [bn, bk/2] are transposed to [bk/2, bn]
so each E8M0 scale (one per 16 bytes along K) is repeated along sublanes by a
tile-aligned broadcast + reshape, and decoded to f32 bit patterns with integer
ops (`format.decode_e2m1_scaled`, exact), then cast to the compute dtype.
Accumulation is f32.

Two grid strategies, one per backend (both run in interpret mode on CPU):

* 'tpu' (Mosaic): megablox-style (the grouped matmul of jax's
  pallas/ops/tpu/megablox). The wrapper lists "visits" (m-tile, group): every
  m-tile once per group it intersects, plus tiles past the last group (no
  group: they are zeroed). Tile ids, group ids and group bounds are
  scalar-prefetched, so BlockSpec index maps pick the visit's x tile and weight
  tile; the visit axis is a dynamic grid bound (the real count, at most
  m_tiles + G - 1), so decoding a few rows against 608 experts runs a few
  visits, not 608. Forward grid (n, visit, k), backward (k, visit, n); an f32
  VMEM accumulator is zeroed on a tile's first visit and written on its last.
  Scales are passed transposed, [G, K/32, N], so their blocks meet the
  (8, 128) tiling rule (a copy of 1/16 of the weight bytes per call).
* 'gpu' (Triton): no scalar prefetch there, so the grid is (m-tile, n-tile)
  (backward: (m-tile, k-tile)) and each program loops over the groups that
  intersect its rows and over the contraction with masked loads from the
  whole arrays (the raw [G, N, K/32] scales; the small scale tile is
  transposed in the kernel).

Masking: rows outside the visited group are dropped after the dot (a NaN in a
neighbouring group's weights cannot leak); a contraction tile that overhangs K
(forward) or N (backward) has both operands zeroed with `where`; overhangs of
output rows/columns are discarded on write-back.

Shape letters: m rows of x, n output features (N), c half-contraction index
(K/2, one nibble plane), g group.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.mxfp4.format import BLOCK, SCALE_BIAS, decode_e2m1_scaled

BACKENDS = ("tpu", "gpu")
_HALF = BLOCK // 2  # bytes (and elements per nibble plane) of one 32-element block


@dataclasses.dataclass(frozen=True)
class Static:
  """Static sizes of one call (hashable: it parameterises the kernels).

  m, n, k2: rows, output features, K/2. groups: G. bm, bn, bk2: tile rows,
  tile features, tile half-contraction (bk2 = block_k / 2). dtype: compute dtype
  of the dots. out_dtype: the result's dtype.
  """
  m: int
  n: int
  k2: int
  groups: int
  bm: int
  bn: int
  bk2: int
  dtype: str
  out_dtype: str

  @property
  def nkb(self) -> int:  # scale bytes per tile along K
    return self.bk2 // _HALF

  @property
  def k32(self) -> int:
    return self.k2 // _HALF

  @property
  def m_tiles(self) -> int:
    return pl.cdiv(self.m, self.bm)

  @property
  def n_steps(self) -> int:
    return pl.cdiv(self.n, self.bn)

  @property
  def k_steps(self) -> int:
    return pl.cdiv(self.k2, self.bk2)

  @property
  def precision(self):
    # f32 operands: full f32 products (TPU/Triton would otherwise use bf16/tf32
    # passes); bf16 operands are exact products at default precision.
    return jax.lax.Precision.HIGHEST if self.dtype == "float32" else None


# ---- shared tile maths -----------------------------------------------------------


def _dequant_t(codes: jax.Array, scales_t: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """Codes [bn, bk2] uint8 + scales [nkb, bn] -> (lo, hi) [bk2, bn] in `dtype`."""
  c = codes.astype(jnp.int32).T  # [c, n]
  nkb, bn = scales_t.shape
  s = scales_t.astype(jnp.int32)
  s = jnp.broadcast_to(s[:, None, :], (nkb, _HALF, bn)).reshape(nkb * _HALF, bn)
  lo = decode_e2m1_scaled(c & 0xF, s).astype(dtype)
  hi = decode_e2m1_scaled(c >> 4, s).astype(dtype)
  return lo, hi


def _mm(a, b, t: Static):
  """a [p, q] @ b [q, r] with f32 accumulation."""
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=t.precision,
                             preferred_element_type=jnp.float32)


def _mm_nt(a, b, t: Static):
  """a [p, q] @ b[r, q]^T with f32 accumulation."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=t.precision,
                             preferred_element_type=jnp.float32)


# ---- group metadata (XLA, outside the kernels) -----------------------------------


def group_bounds(group_sizes: jax.Array, m: int) -> jax.Array:
  """[G] sizes -> [G + 1] int32 row offsets (group g owns rows bounds[g]:bounds[g+1]).

  Clamped to the m rows that exist, so sizes summing past m cannot address
  rows (or tiles) beyond x.
  """
  ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])


def tpu_visits(group_sizes: jax.Array, m: int, bm: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(tile_ids, group_ids) int32 [m_tiles + G - 1] of the 'tpu' grid, and the visit count.

  Visits are sorted by tile: each m-tile once per group whose rows it holds,
  then the tiles past the last group. Group id G means "no group": nothing is
  accumulated, but the tile's accumulator is still zeroed and written. The
  grid runs only the first `count` visits (a dynamic grid bound); the rest of
  the static-length arrays is padding repeating the last tile.
  """
  g = group_sizes.shape[0]
  m_tiles = pl.cdiv(m, bm)
  bounds = group_bounds(group_sizes, m)
  starts, ends = bounds[:-1], bounds[1:]
  sizes = ends - starts
  counts = jnp.where(sizes > 0, (ends - 1) // bm - starts // bm + 1, 0)
  tail_first = jnp.minimum((bounds[-1] + bm - 1) // bm, m_tiles)
  counts = jnp.concatenate([counts, (m_tiles - tail_first)[None]])
  firsts = jnp.concatenate([starts // bm, tail_first[None]])
  offsets = jnp.cumsum(counts) - counts
  v = jnp.arange(m_tiles + g - 1, dtype=jnp.int32)
  grp = jnp.searchsorted(jnp.cumsum(counts), v, side="right").astype(jnp.int32)  # G + 1: padding
  owner = jnp.minimum(grp, g)
  tiles = jnp.where(grp > g, m_tiles - 1, firsts[owner] + v - offsets[owner])
  return tiles.astype(jnp.int32), owner.astype(jnp.int32), jnp.sum(counts).astype(jnp.int32)


def gpu_group_ranges(group_sizes: jax.Array, m: int, bm: int) -> tuple[jax.Array, jax.Array]:
  """(g_lo, g_hi) int32 [m_tiles]: groups g_lo <= g < g_hi intersect m-tile i's rows."""
  bounds = group_bounds(group_sizes, m)
  tile_start = jnp.arange(pl.cdiv(m, bm), dtype=jnp.int32) * bm
  tile_end = jnp.minimum(tile_start + bm, m)
  g_lo = jnp.searchsorted(bounds[1:], tile_start, side="right")
  g_hi = jnp.searchsorted(bounds[:-1], tile_end, side="left")
  return g_lo.astype(jnp.int32), g_hi.astype(jnp.int32)


# ---- 'tpu' strategy: scalar-prefetched visits, BlockSpecs, VMEM accumulator ----


def _visit_flags(tile_ref, v):
  """(first, last): visit v is the first / last visit of its tile."""
  nv = pl.num_programs(1)
  tile = tile_ref[v]
  first = jnp.logical_or(v == 0, tile_ref[jnp.maximum(v - 1, 0)] != tile)
  last = jnp.logical_or(v == nv - 1, tile_ref[jnp.minimum(v + 1, nv - 1)] != tile)
  return first, last


def _rows_inside(bounds_ref, tile, g, bm):
  rows = tile * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
  return jnp.logical_and(rows >= bounds_ref[g], rows < bounds_ref[g + 1])


def _tpu_kernel(tile_ref, group_ref, bounds_ref, in_ref, c_ref, s_ref, out_ref, acc_ref, *,
                t: Static, tile_update):
  """One (visit, step) of the 'tpu' grid: zero the tile's accumulator on its first visit,
  add `tile_update` for a visit that has a group, write the tile on its last visit.

  The third grid axis (`step`) is the contraction: K tiles forward, N tiles backward.
  """
  v, step = pl.program_id(1), pl.program_id(2)
  g = group_ref[v]
  first, last = _visit_flags(tile_ref, v)

  @pl.when(jnp.logical_and(first, step == 0))
  def _init():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(g < t.groups)
  def _accumulate():
    lo, hi = _dequant_t(c_ref[...], s_ref[...], t.dtype)  # [bk2, bn]
    tile_update(in_ref, lo, hi, step, _rows_inside(bounds_ref, tile_ref[v], g, t.bm), acc_ref, t)

  @pl.when(jnp.logical_and(last, step == pl.num_programs(2) - 1))
  def _store():
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _fwd_tile(x_ref, lo, hi, k, inside, acc_ref, t: Static):
  """acc [bm, bn] += x_even lo + x_odd hi over K tile k."""
  xe, xo = x_ref[0].astype(t.dtype), x_ref[1].astype(t.dtype)  # [bm, bk2]
  if t.k2 % t.bk2:  # the last K tile overhangs: zero both operands there
    col = k * t.bk2 + jax.lax.broadcasted_iota(jnp.int32, (1, t.bk2), 1)
    xe, xo = jnp.where(col < t.k2, xe, 0), jnp.where(col < t.k2, xo, 0)
    row = k * t.bk2 + jax.lax.broadcasted_iota(jnp.int32, (t.bk2, 1), 0)
    lo, hi = jnp.where(row < t.k2, lo, 0), jnp.where(row < t.k2, hi, 0)
  acc_ref[...] += jnp.where(inside, _mm(xe, lo, t) + _mm(xo, hi, t), 0.0)


def _bwd_tile(dy_ref, lo, hi, n, inside, acc_ref, t: Static):
  """acc [2, bm, bk2] += (dy lo^T, dy hi^T) over N tile n."""
  dy = dy_ref[...].astype(t.dtype)  # [bm, bn]
  if t.n % t.bn:  # the last N tile overhangs the contraction
    col = n * t.bn + jax.lax.broadcasted_iota(jnp.int32, (1, t.bn), 1)
    dy = jnp.where(col < t.n, dy, 0)
    lo, hi = jnp.where(col < t.n, lo, 0), jnp.where(col < t.n, hi, 0)
  acc_ref[0] += jnp.where(inside, _mm_nt(dy, lo, t), 0.0)
  acc_ref[1] += jnp.where(inside, _mm_nt(dy, hi, t), 0.0)


def _tpu_call(operand, codes, scales_t, group_sizes, t: Static, interpret: bool, backward: bool):
  """The 'tpu' pallas_call: grid (n, visit, k) forward, (k, visit, n) backward.

  Forward: operand xp [2, M, K/2] -> y [M, N]; backward: dy [M, N] -> dxp [2, M, K/2].
  """
  tiles, groups, count = tpu_visits(group_sizes, t.m, t.bm)
  last_g = t.groups - 1

  def spec(shape, index):
    """BlockSpec whose index map sees (n tile, k tile, m tile, weight group) of the visit."""
    def index_map(outer, v, step, tl, gr, _):
      n, k = (step, outer) if backward else (outer, step)
      return index(n, k, tl[v], jnp.minimum(gr[v], last_g))
    return pl.BlockSpec(shape, index_map)

  halves = spec((2, t.bm, t.bk2), lambda n, k, tile, g: (0, tile, k))  # xp / dxp
  rows = spec((t.bm, t.bn), lambda n, k, tile, g: (tile, n))  # y / dy
  weights = [spec((pl.squeezed, t.bn, t.bk2), lambda n, k, tile, g: (g, n, k)),
             spec((pl.squeezed, t.nkb, t.bn), lambda n, k, tile, g: (g, k, n))]
  if backward:
    grid, in_spec, out_spec = (t.k_steps, count, t.n_steps), rows, halves
    out_shape, tile_update, name = (2, t.m, t.k2), _bwd_tile, "mxfp4_ragged_bwd"
  else:
    grid, in_spec, out_spec = (t.n_steps, count, t.k_steps), halves, rows
    out_shape, tile_update, name = (t.m, t.n), _fwd_tile, "mxfp4_ragged_fwd"
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3, grid=grid, in_specs=[in_spec, *weights], out_specs=out_spec,
      scratch_shapes=[pltpu.VMEM(out_spec.block_shape, jnp.float32)])
  params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"))
  return pl.pallas_call(
      functools.partial(_tpu_kernel, t=t, tile_update=tile_update), grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct(out_shape, t.out_dtype),
      compiler_params=None if interpret else params, interpret=interpret, name=name,
  )(tiles, groups, group_bounds(group_sizes, t.m), operand, codes, scales_t)


# ---- 'gpu' strategy: per-program loops over groups and the contraction -----------


def _gpu_weight_tile(c_ref, s_ref, g, n0, kk, n_ok, t: Static):
  """Masked loads of group g's codes [bn, bk2] and scales [bn, nkb] -> (lo, hi) [bk2, bn]."""
  k_ok = kk * t.bk2 + jnp.arange(t.bk2) < t.k2
  kb_ok = kk * t.nkb + jnp.arange(t.nkb) < t.k32
  codes = plgpu.load(c_ref.at[g, pl.ds(n0, t.bn), pl.ds(kk * t.bk2, t.bk2)],
                     mask=n_ok[:, None] & k_ok[None, :], other=0)
  scales = plgpu.load(s_ref.at[g, pl.ds(n0, t.bn), pl.ds(kk * t.nkb, t.nkb)],
                      mask=n_ok[:, None] & kb_ok[None, :], other=SCALE_BIAS)
  return _dequant_t(codes, scales.T, t.dtype)


def _gpu_fwd_kernel(glo_ref, ghi_ref, bounds_ref, x_ref, c_ref, s_ref, o_ref, *, t: Static):
  i, j = pl.program_id(0), pl.program_id(1)
  rows = i * t.bm + jnp.arange(t.bm)
  row_ok = rows < t.m
  n_ok = j * t.bn + jnp.arange(t.bn) < t.n

  def group_step(g, acc):
    inside = (rows >= bounds_ref[g]) & (rows < bounds_ref[g + 1])

    def k_step(kk, acc):
      xmask = row_ok[:, None] & (kk * t.bk2 + jnp.arange(t.bk2) < t.k2)[None, :]
      window = (pl.ds(i * t.bm, t.bm), pl.ds(kk * t.bk2, t.bk2))
      xe = plgpu.load(x_ref.at[(jnp.int32(0), *window)], mask=xmask, other=0).astype(t.dtype)
      xo = plgpu.load(x_ref.at[(jnp.int32(1), *window)], mask=xmask, other=0).astype(t.dtype)
      lo, hi = _gpu_weight_tile(c_ref, s_ref, g, j * t.bn, kk, n_ok, t)
      return acc + jnp.where(inside[:, None], _mm(xe, lo, t) + _mm(xo, hi, t), 0.0)

    nonempty = bounds_ref[g + 1] > bounds_ref[g]
    return jax.lax.cond(nonempty, lambda a: jax.lax.fori_loop(0, t.k_steps, k_step, a),
                        lambda a: a, acc)

  acc = jax.lax.fori_loop(glo_ref[i], ghi_ref[i], group_step, jnp.zeros((t.bm, t.bn), jnp.float32))
  plgpu.store(o_ref.at[pl.ds(i * t.bm, t.bm), pl.ds(j * t.bn, t.bn)], acc.astype(o_ref.dtype),
              mask=row_ok[:, None] & n_ok[None, :])


def _gpu_bwd_kernel(glo_ref, ghi_ref, bounds_ref, dy_ref, c_ref, s_ref, dx_ref, *, t: Static):
  i, kk = pl.program_id(0), pl.program_id(1)
  rows = i * t.bm + jnp.arange(t.bm)
  row_ok = rows < t.m

  def group_step(g, accs):
    inside = ((rows >= bounds_ref[g]) & (rows < bounds_ref[g + 1]))[:, None]

    def n_step(n, accs):
      n_ok = n * t.bn + jnp.arange(t.bn) < t.n
      dy = plgpu.load(dy_ref.at[pl.ds(i * t.bm, t.bm), pl.ds(n * t.bn, t.bn)],
                      mask=row_ok[:, None] & n_ok[None, :], other=0).astype(t.dtype)
      lo, hi = _gpu_weight_tile(c_ref, s_ref, g, n * t.bn, kk, n_ok, t)
      return (accs[0] + jnp.where(inside, _mm_nt(dy, lo, t), 0.0),
              accs[1] + jnp.where(inside, _mm_nt(dy, hi, t), 0.0))

    nonempty = bounds_ref[g + 1] > bounds_ref[g]
    return jax.lax.cond(nonempty, lambda a: jax.lax.fori_loop(0, t.n_steps, n_step, a),
                        lambda a: a, accs)

  zeros = jnp.zeros((t.bm, t.bk2), jnp.float32)
  acc_e, acc_o = jax.lax.fori_loop(glo_ref[i], ghi_ref[i], group_step, (zeros, zeros))
  k_ok = kk * t.bk2 + jnp.arange(t.bk2) < t.k2
  mask = row_ok[:, None] & k_ok[None, :]
  window = (pl.ds(i * t.bm, t.bm), pl.ds(kk * t.bk2, t.bk2))
  plgpu.store(dx_ref.at[(jnp.int32(0), *window)], acc_e.astype(dx_ref.dtype), mask=mask)
  plgpu.store(dx_ref.at[(jnp.int32(1), *window)], acc_o.astype(dx_ref.dtype), mask=mask)


def _gpu_call(operand, codes, scales, group_sizes, t: Static, interpret: bool, backward: bool):
  """The 'gpu' pallas_call: grid (m tile, n tile) forward, (m tile, k tile) backward.

  Forward: operand xp [2, M, K/2] -> y [M, N]; backward: dy [M, N] -> dxp [2, M, K/2].
  """
  g_lo, g_hi = gpu_group_ranges(group_sizes, t.m, t.bm)
  if backward:
    body, grid, out_shape = _gpu_bwd_kernel, (t.m_tiles, t.k_steps), (2, t.m, t.k2)
  else:
    body, grid, out_shape = _gpu_fwd_kernel, (t.m_tiles, t.n_steps), (t.m, t.n)
  return pl.pallas_call(
      functools.partial(body, t=t), grid=grid, out_shape=jax.ShapeDtypeStruct(out_shape, t.out_dtype),
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret, name="mxfp4_ragged_bwd" if backward else "mxfp4_ragged_fwd",
  )(g_lo, g_hi, group_bounds(group_sizes, t.m), operand, codes, scales)


# ---- entry points used by ops.py --------------------------------------------------


def _weights_for(backend: str, blocks: jax.Array, scales: jax.Array):
  """gpt-oss blocks [G, N, K/32, 16] / scales [G, N, K/32] -> the kernel's operands."""
  g, n, k32, _ = blocks.shape
  codes = blocks.reshape(g, n, k32 * _HALF)  # free: same bytes, row-major
  if backend == "tpu":
    scales = jnp.swapaxes(scales, 1, 2)  # [G, K/32, N]: (8, 128)-tileable blocks
  return codes, scales


def _ragged_call(operand, blocks, scales, group_sizes, t: Static, backend: str, interpret: bool,
                 backward: bool) -> jax.Array:
  codes, scales = _weights_for(backend, blocks, scales)
  impl = _tpu_call if backend == "tpu" else _gpu_call
  return impl(operand, codes, scales, group_sizes, t, interpret, backward)


def ragged_forward(xp: jax.Array, blocks: jax.Array, scales: jax.Array, group_sizes: jax.Array,
                   t: Static, backend: str, interpret: bool) -> jax.Array:
  """xp [2, M, K/2] (x_even, x_odd) -> [M, N] in t.out_dtype."""
  return _ragged_call(xp, blocks, scales, group_sizes, t, backend, interpret, backward=False)


def ragged_backward(dy: jax.Array, blocks: jax.Array, scales: jax.Array, group_sizes: jax.Array,
                    t: Static, backend: str, interpret: bool) -> jax.Array:
  """dy [M, N] -> d(xp) [2, M, K/2] in t.out_dtype (here: x's dtype)."""
  return _ragged_call(dy, blocks, scales, group_sizes, t, backend, interpret, backward=True)


def split_parity(x2: jax.Array) -> jax.Array:
  """x [M, K] -> [2, M, K/2]: elements 2i of every 32-block (low nibbles), then 2i + 1."""
  m, k = x2.shape
  return jnp.moveaxis(x2.reshape(m, k // 2, 2), 2, 0)


def merge_parity(xp: jax.Array) -> jax.Array:
  """Inverse of `split_parity`: [2, M, K/2] -> [M, K]."""
  _, m, k2 = xp.shape
  return jnp.moveaxis(xp, 0, 2).reshape(m, 2 * k2)
