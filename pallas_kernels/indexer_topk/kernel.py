"""Pallas kernel: lightning-indexer scores with a running exact top-k (DeepSeek-V3.2 DSA).

The indexer (DeepSeek-AI, "DeepSeek-V3.2-Exp", 2025) scores every allowed
key, I[t,s] = sum_h w[t,h] relu(q[t,h] . k[s]), and the main attention
reads only each query's top-k keys. Materialising I is O(N^2) memory; here
a query tile keeps its running top-k in fast memory while key blocks stream
past, so only O(N*k) (the result) ever exists.

Per (batch, query tile of bq) the kernel visits the key blocks that can
hold an allowed key (a [lo, hi) range per tile from block-level
position/segment bounds, like the XLA path) and, per key block of kb keys:

1. scores it in chunks of M keys (MXU/tensor-core matmuls per head, f32),
   masked to -inf where the key is not allowed, into the candidate list;
2. skips the merge when no new key beats any query's current k-th entry;
3. otherwise merges by rank: candidates are the sorted running list (Kp
   entries) plus the block, under the strict total order "higher score,
   then lower key index" (= lax.top_k's tie order, which the XLA path's
   running merge reproduces). A candidate's new position is the number of
   candidates that beat it (the running list's own positions are known
   since it is sorted), and position r < Kp is filled by the candidate of
   rank r. Everything is chunk-by-chunk broadcast compares, reductions and
   selects on [bq, M, M] tiles, which Mosaic and Triton both lower; there is
   no sort, gather or scatter inside the kernel.

Cost: O(Kp * (Kp + kb)) compares per query and merged key block, so
kb ~ Kp is the sweet spot (about 5*Kp compares per scored key; a sorting
network would need O(log^2) but has no portable lowering).

Backends: TPU keeps the state in VMEM scratch across an "arbitrary" key
block grid axis (the key block index_map is clamped to [lo, hi) from scalar
prefetch, so skipped blocks are not fetched); Triton has no scratch and no
sequential grid axis, so one program loops over key blocks and keeps its
state in its slice of global-memory outputs (the result itself plus
scratch outputs), with CTA barriers between phases.

Layouts (ops.py prepares them): q [b, H, Tp, d], w [b, H, Tp, 1] f32,
q_pos/q_seg [b, Tp, 1], k [b, Sp, d], k_pos/k_seg [b, Sp/M, 1, M];
result vals/ids [b, Tp/bq, Kp/M, bq, M] (chunk-major per tile).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

_F32, _I32 = jnp.float32, jnp.int32
_NT = (((1,), (1,)), ((), ()))
_INT_MIN = jnp.iinfo(jnp.int32).min


@dataclasses.dataclass(frozen=True)
class Geometry:
  """Static sizes (padded as the kernel sees them)."""
  batch: int
  queries: int  # Tp, multiple of block_q
  keys: int     # Sp, multiple of block_k
  heads: int
  dim: int
  slots: int    # Kp, multiple of chunk
  block_q: int
  block_k: int  # kb, multiple of chunk
  chunk: int    # M
  backend: str
  interpret: bool | pltpu.InterpretParams

  @property
  def n_state(self) -> int:  # nc
    return self.slots // self.chunk

  @property
  def n_new(self) -> int:  # nb
    return self.block_k // self.chunk

  @property
  def n_q_tiles(self) -> int:
    return self.queries // self.block_q

  @property
  def n_k_blocks(self) -> int:
    return self.keys // self.block_k


def _beats(av, ai, bv, bi):
  """a before b in the top-k order: higher score, ties to the lower key index."""
  return (av > bv) | ((av == bv) & (ai < bi))


@dataclasses.dataclass
class _State:
  """Refs of one tile's merge: sorted state, new candidates, ranks, placement output."""
  st_v: object
  st_i: object
  nw_v: object
  nw_i: object
  rank: object
  tmp_v: object
  tmp_i: object


def _init_state(geo: Geometry, st: _State) -> None:
  lane = lax.broadcasted_iota(_I32, (geo.block_q, geo.chunk), 1)

  def body(a, c):
    st.st_v[a] = jnp.full((geo.block_q, geo.chunk), -jnp.inf, _F32)
    st.st_i[a] = -1 - (a * geo.chunk + lane)  # distinct placeholders, all invalid (-inf)
    return c

  lax.fori_loop(0, geo.n_state, body, 0)


def _fill(geo: Geometry, st: _State, score_chunk) -> jax.Array:
  """Scores the key block into st.nw_*; returns int32 > 0 iff some new key beats a k-th entry."""
  last_v, last_i = st.st_v[geo.n_state - 1], st.st_i[geo.n_state - 1]
  kth_v = jnp.min(last_v, axis=1, keepdims=True)
  kth_i = jnp.max(jnp.where(last_v == kth_v, last_i, _INT_MIN), axis=1, keepdims=True)

  def body(jc, entered):
    v, ids = score_chunk(jc)
    st.nw_v[jc] = v
    st.nw_i[jc] = ids
    return jnp.maximum(entered, jnp.max(_beats(v, ids, kth_v, kth_i).astype(_I32)))

  return lax.fori_loop(0, geo.n_new, body, jnp.zeros((), _I32))


def _count_beating(sv, si, ref_v, ref_i, n: int):
  """[bq, M] counts: how many entries of the n chunks of (ref_v, ref_i) beat (sv, si)."""
  def body(o, acc):
    ov, oi = ref_v[o][:, :, None], ref_i[o][:, :, None]
    beat = _beats(ov, oi, sv[:, None, :], si[:, None, :])  # [bq, M other, M self]
    return acc + jnp.sum(beat.astype(_I32), axis=1)
  return lax.fori_loop(0, n, body, jnp.zeros(sv.shape, _I32))


def _merge(geo: Geometry, st: _State, sync) -> None:
  """state <- top Kp of (state, new) by rank; see the module docstring."""
  nc, nb, m = geo.n_state, geo.n_new, geo.chunk
  lane = lax.broadcasted_iota(_I32, (1, m), 1)

  def rank_old(a, c):  # sorted state: entries before it beat it; new ones only by count
    st.rank[a] = a * m + lane + _count_beating(st.st_v[a], st.st_i[a], st.nw_v, st.nw_i, nb)
    return c

  def rank_new(a, c):
    sv, si = st.nw_v[a], st.nw_i[a]
    st.rank[nc + a] = (_count_beating(sv, si, st.st_v, st.st_i, nc)
                       + _count_beating(sv, si, st.nw_v, st.nw_i, nb))
    return c

  lax.fori_loop(0, nc, rank_old, 0)
  lax.fori_loop(0, nb, rank_new, 0)
  sync()

  def place(r, c):
    want = (r * m + lane)[:, None, :]  # [1, 1, M out]

    def take(ref_v, ref_i, base):
      def body(a, carry):
        eq = st.rank[base + a][:, :, None] == want  # [bq, M cand, M out]
        tv = jnp.maximum(carry[0], jnp.max(jnp.where(eq, ref_v[a][:, :, None], -jnp.inf), axis=1))
        return tv, carry[1] + jnp.sum(jnp.where(eq, ref_i[a][:, :, None], 0), axis=1)
      return body

    carry = (jnp.full((geo.block_q, m), -jnp.inf, _F32), jnp.zeros((geo.block_q, m), _I32))
    carry = lax.fori_loop(0, nc, take(st.st_v, st.st_i, 0), carry)
    carry = lax.fori_loop(0, nb, take(st.nw_v, st.nw_i, nc), carry)
    st.tmp_v[r], st.tmp_i[r] = carry
    return c

  lax.fori_loop(0, nc, place, 0)
  sync()

  def copy(r, c):
    st.st_v[r] = st.tmp_v[r]
    st.st_i[r] = st.tmp_i[r]
    return c

  lax.fori_loop(0, nc, copy, 0)
  sync()


def _score_chunk_fn(geo: Geometry, q_ref, w_ref, qp_ref, qs_ref, load_keys):
  """jc -> (masked scores [bq, M] f32, key ids [bq, M]); load_keys(jc) -> (k, kpos, kseg, first id)."""
  def score(jc):
    kk, kp, ks, first = load_keys(jc)

    def head(h, acc):
      if geo.backend == "triton" and geo.block_q < 16:  # below Triton's minimum dot tile
        dots = jnp.sum(q_ref[h].astype(_F32)[:, None, :] * kk.astype(_F32)[None, :, :], axis=-1)
      else:
        dots = lax.dot_general(q_ref[h], kk.astype(q_ref.dtype), _NT, preferred_element_type=_F32)
      return acc + w_ref[h] * jnp.maximum(dots, 0.0)

    acc = lax.fori_loop(0, geo.heads, head, jnp.zeros((geo.block_q, geo.chunk), _F32))
    qs = qs_ref[...]
    allowed = (ks == qs) & (ks >= 0) & (kp <= qp_ref[...])
    ids = first + lax.broadcasted_iota(_I32, (geo.block_q, geo.chunk), 1)
    return jnp.where(allowed, acc, -jnp.inf), ids
  return score


def _block_step(geo: Geometry, st: _State, score, sync) -> None:
  entered = _fill(geo, st, score)
  sync()

  @pl.when(entered > 0)
  def _():
    _merge(geo, st, sync)


def _tpu_kernel(geo: Geometry, bounds_ref, q_ref, w_ref, qp_ref, qs_ref, k_ref, kp_ref, ks_ref,
                out_v, out_i, *scratch):
  i, j = pl.program_id(1), pl.program_id(2)
  st = _State(*scratch)
  m = geo.chunk

  @pl.when(j == 0)
  def _():
    _init_state(geo, st)

  def load_keys(jc):
    start = pl.multiple_of(jc * m, m)
    return k_ref[pl.ds(start, m), :], kp_ref[jc], ks_ref[jc], (j * geo.n_new + jc) * m

  score = _score_chunk_fn(geo, q_ref, w_ref, qp_ref, qs_ref, load_keys)

  @pl.when((j >= bounds_ref[i, 0]) & (j < bounds_ref[i, 1]))
  def _():
    _block_step(geo, st, score, lambda: None)

  @pl.when(j == geo.n_k_blocks - 1)
  def _():
    out_v[...] = st.st_v[...]
    out_i[...] = st.st_i[...]


def _triton_kernel(geo: Geometry, bounds_ref, q_ref, w_ref, qp_ref, qs_ref, k_ref, kp_ref, ks_ref,
                   out_v, out_i, *scratch):
  i = pl.program_id(1)
  st = _State(out_v, out_i, *scratch)
  m = geo.chunk
  sync = (lambda: None) if geo.interpret else plgpu.debug_barrier
  _init_state(geo, st)
  sync()

  def per_block(j, c):
    def load_keys(jc):
      g = j * geo.n_new + jc
      return k_ref[pl.ds(g * m, m), :], kp_ref[g], ks_ref[g], g * m

    _block_step(geo, st, _score_chunk_fn(geo, q_ref, w_ref, qp_ref, qs_ref, load_keys), sync)
    return c

  lax.fori_loop(bounds_ref[i, 0], bounds_ref[i, 1], per_block, 0)


def topk(geo: Geometry, bounds, q, w, q_pos, q_seg, k, k_pos, k_seg):
  """Running top-Kp per query. Returns vals f32 and ids int32, both [b, Tp/bq, Kp/M, bq, M]."""
  b, bq, m, d, h = geo.batch, geo.block_q, geo.chunk, geo.dim, geo.heads
  nq, nc, nb = geo.n_q_tiles, geo.n_state, geo.n_new
  res_shape = (b, nq, nc, bq, m)
  out_shape = [jax.ShapeDtypeStruct(res_shape, _F32), jax.ShapeDtypeStruct(res_shape, _I32)]
  args = (bounds, q, w, q_pos, q_seg, k, k_pos, k_seg)
  if geo.backend == "tpu":
    n_kb = geo.n_k_blocks

    def kblk(j, bnd, i):  # clamp into [lo, hi): skipped blocks repeat an index and are not fetched
      return jnp.maximum(bnd[i, 0], jnp.minimum(j, bnd[i, 1] - 1))

    in_specs = [pl.BlockSpec((None, h, bq, d), lambda b_, i, j, bnd: (b_, 0, i, 0)),
                pl.BlockSpec((None, h, bq, 1), lambda b_, i, j, bnd: (b_, 0, i, 0)),
                pl.BlockSpec((None, bq, 1), lambda b_, i, j, bnd: (b_, i, 0)),
                pl.BlockSpec((None, bq, 1), lambda b_, i, j, bnd: (b_, i, 0)),
                pl.BlockSpec((None, geo.block_k, d), lambda b_, i, j, bnd: (b_, kblk(j, bnd, i), 0)),
                pl.BlockSpec((None, nb, 1, m), lambda b_, i, j, bnd: (b_, kblk(j, bnd, i), 0, 0)),
                pl.BlockSpec((None, nb, 1, m), lambda b_, i, j, bnd: (b_, kblk(j, bnd, i), 0, 0))]
    res = pl.BlockSpec((None, None, nc, bq, m), lambda b_, i, j, bnd: (b_, i, 0, 0, 0))
    scratch = [pltpu.VMEM((nc, bq, m), _F32), pltpu.VMEM((nc, bq, m), _I32),
               pltpu.VMEM((nb, bq, m), _F32), pltpu.VMEM((nb, bq, m), _I32),
               pltpu.VMEM((nc + nb, bq, m), _I32),
               pltpu.VMEM((nc, bq, m), _F32), pltpu.VMEM((nc, bq, m), _I32)]
    grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(b, nq, n_kb), in_specs=in_specs,
                                             out_specs=[res, res], scratch_shapes=scratch)
    interpret = geo.interpret
    if interpret is True:
      interpret = pltpu.InterpretParams()
    params = None if geo.interpret else pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "arbitrary"))
    kern = lambda *refs: _tpu_kernel(geo, *refs)
    return pl.pallas_call(kern, grid_spec=grid_spec, out_shape=out_shape, compiler_params=params,
                          interpret=interpret)(*args)

  nkc = geo.keys // m
  tile = lambda n: pl.BlockSpec((None, None, n, bq, m), lambda b_, i: (b_, i, 0, 0, 0))
  in_specs = [pl.BlockSpec((nq, 2), lambda b_, i: (0, 0)),
              pl.BlockSpec((None, h, bq, d), lambda b_, i: (b_, 0, i, 0)),
              pl.BlockSpec((None, h, bq, 1), lambda b_, i: (b_, 0, i, 0)),
              pl.BlockSpec((None, bq, 1), lambda b_, i: (b_, i, 0)),
              pl.BlockSpec((None, bq, 1), lambda b_, i: (b_, i, 0)),
              pl.BlockSpec((None, geo.keys, d), lambda b_, i: (b_, 0, 0)),
              pl.BlockSpec((None, nkc, 1, m), lambda b_, i: (b_, 0, 0, 0)),
              pl.BlockSpec((None, nkc, 1, m), lambda b_, i: (b_, 0, 0, 0))]
  # Outputs: the result (= running state) and the merge's global-memory scratch.
  shapes = [(nc, _F32), (nc, _I32), (nb, _F32), (nb, _I32), (nc + nb, _I32), (nc, _F32), (nc, _I32)]
  out_shape = [jax.ShapeDtypeStruct((b, nq, n, bq, m), dt) for n, dt in shapes]
  params = None if geo.interpret else plgpu.CompilerParams(num_warps=4, num_stages=1)
  kern = lambda *refs: _triton_kernel(geo, *refs)
  outs = pl.pallas_call(kern, grid=(b, nq), in_specs=in_specs, out_specs=[tile(n) for n, _ in shapes],
                        out_shape=out_shape, compiler_params=params, interpret=bool(geo.interpret))(*args)
  return outs[0], outs[1]
