"""Public Pallas blockwise top-k: a drop-in for model.attention.sparse.blockwise_topk.

Same signature and results (indices, validity, and lax.top_k's tie order:
higher score first, ties to the lower key index) as the XLA path, plus
keyword-only `block`, `interpret` and `backend`. The lightning-indexer
scores (DeepSeek-V3.2-Exp) are computed block by block inside the kernel
and folded into a running top-k there (kernel.py), so neither an N x N
score matrix nor a [query_block, key_block, heads] score tile reaches HBM.

`query_block` is the XLA path's tiling and only validated here (the kernel's
query tile is `block.block_q`: the merge works on [block_q, M, M] tiles in
fast memory, far smaller than a useful XLA query block). `key_block` is the
default kernel key block: the keys merged at once, whose best size is about
topk (see kernel.py's cost note).

No gradient flows through the selection (inputs are stop_gradient'ed, as in
the XLA path).

Memory: the result is [b, t, topk] values + indices as in the XLA path. On
Triton the merge also needs global-memory scratch (Triton kernels have no
scratch memory) of about three times the result's bytes when block_k ~ topk.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.backend import resolve_backend, resolve_interpret
from pallas_kernels.common import as_python_ints as _as_python_ints
from pallas_kernels.common import is_pow2 as _pow2
from pallas_kernels.common import need as _need
from pallas_kernels.common import next_pow2 as _next_pow2
from pallas_kernels.common import pad_axis1 as _pad1
from pallas_kernels.common import positive_int as _positive_int
from pallas_kernels.common import round_up as _round_up
from pallas_kernels.indexer_topk import kernel
from pallas_kernels.indexer_topk.reference import check_topk_args, needed_blocks


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the indexer top-k kernel.

  Attributes:
    block_q: queries per tile (their running top-k stays in fast memory).
    block_k: keys scored and merged at once; a multiple of `chunk`. None =
      the call's key_block rounded up to a chunk multiple.
    chunk: keys per scoring matmul and per merge tile (M); the merge works on
      [block_q, chunk, chunk] compare tiles.
  """
  block_q: int = 8
  block_k: int | None = None
  chunk: int = 128

  def __post_init__(self):
    for name in ("block_q", "chunk"):
      _need(_pow2(getattr(self, name)),
            f"BlockSizes.{name}={getattr(self, name)!r} must be a positive power of two.")
    _need(self.block_k is None or (_positive_int(self.block_k) is not None
                                   and self.block_k % self.chunk == 0),
          f"BlockSizes.block_k={self.block_k!r} must be None or a positive multiple of chunk={self.chunk}.")
    _as_python_ints(self, "block_q", "block_k", "chunk")

  @classmethod
  def default(cls, backend: str) -> "BlockSizes":
    """TPU: 8 queries, 128-key chunks (lane-dense); Triton: 16 queries, 32-key chunks (registers)."""
    return cls(8, None, 128) if backend == "tpu" else cls(16, None, 32)


def _check_args(q_idx, w_idx, k_idx, q_pos, q_seg, k_pos, k_seg, topk, query_block, key_block):
  """The reference's checks (the XLA path runs them too: same messages), plus at least one head."""
  check_topk_args(q_idx, w_idx, k_idx, q_pos, q_seg, k_pos, k_seg, topk, query_block, key_block)
  b, t, h, d = q_idx.shape
  _need(h > 0, f"pallas blockwise_topk: need at least one indexer head, got q_idx {q_idx.shape}.")
  return b, t, h, d, k_idx.shape[1]


def _geometry(dims, topk: int, key_block: int, block: BlockSizes, backend: str, interpret):
  b, t, h, d, s = dims
  fn = "pallas blockwise_topk"
  # Fewer queries than a tile (decode): one tile of t queries (TPU: a block may
  # equal the full dimension; Triton: the next power of two, and tiles under 16
  # rows score with a broadcast multiply instead of a tensor-core dot).
  m = block.chunk
  if backend == "triton":  # power-of-two tiles; dots need every dim >= 16
    m, bq, dp = max(m, 16), min(block.block_q, _next_pow2(t)), _next_pow2(d, 16)
  else:
    bq, dp = min(block.block_q, t), d
  kb = _round_up(block.block_k or min(key_block, s), m)  # Triton may have raised m past chunk
  tp, sp = _round_up(t, bq), _round_up(s, kb)
  if backend == "tpu":
    _need(bq % 8 == 0 or tp == bq, f"{fn}: on TPU block_q={bq} must be a multiple of 8 (or cover all "
          f"{t} queries in one tile); use BlockSizes(block_q=8).")
    _need(kb % 8 == 0 or sp == kb, f"{fn}: on TPU block_k={kb} must be a multiple of 8.")
  return kernel.Geometry(batch=b, queries=tp, keys=sp, heads=h, dim=dp, slots=_round_up(topk, m),
                         block_q=bq, block_k=kb, chunk=m, backend=backend, interpret=interpret)


def tile_bounds(q_pos, q_seg, k_pos, k_seg, block_q: int, block_k: int) -> jax.Array:
  """[n_q_tiles, 2] int32 [lo, hi) key-block range per query tile that may hold an allowed key.

  Conservative (block-level min/max of positions and segments, as the XLA
  path); the exact mask is applied inside the kernel. Padded arrays in.
  """
  needed = needed_blocks(q_pos, q_seg, k_pos, k_seg, block_q, block_k)  # [nq, nk]
  nk = needed.shape[1]
  some = jnp.any(needed, axis=1)
  lo = jnp.where(some, jnp.argmax(needed, axis=1), 0)
  hi = jnp.where(some, nk - jnp.argmax(needed[:, ::-1], axis=1), 0)
  return jnp.stack([lo, hi], axis=1).astype(jnp.int32)


def blockwise_topk(q_idx: jax.Array, w_idx: jax.Array, k_idx: jax.Array, q_pos: jax.Array,
                   q_seg: jax.Array, k_pos: jax.Array, k_seg: jax.Array, topk: int,
                   query_block: int, key_block: int, *, block: BlockSizes | None = None,
                   interpret: bool | pltpu.InterpretParams | None = None,
                   backend: str | None = None) -> tuple[jax.Array, jax.Array]:
  """Top-k keys per query under the lightning-indexer score, in one Pallas kernel.

  Key s is allowed for query t iff k_seg[s] == q_seg[t], k_seg[s] >= 0 and
  k_pos[s] <= q_pos[t]; I[t,s] = sum_h w[t,h] relu(q[t,h] . k[s]) in f32.

  Args:
    q_idx: [b, t, h, k] indexer queries.
    w_idx: [b, t, h] indexer head weights.
    k_idx: [b, s, k] indexer keys.
    q_pos, q_seg: [b, t] int query positions and segment ids.
    k_pos, k_seg: [b, s] int key positions and segment ids (k_seg < 0: unfilled slot).
    topk: slots per query (may exceed the number of allowed keys).
    query_block: the XLA path's query tile (validated, unused here).
    key_block: default kernel key block (see module doc).
    block: kernel tile sizes (default: BlockSizes.default(backend)).
    interpret: interpret mode (None: on CPU only); True uses the backend's
      interpreter (TPU: pltpu.InterpretParams()), or pass InterpretParams.
    backend: "tpu" or "triton" (None: by the default JAX backend).

  Returns:
    idx [b, t, topk] int32 (0 where invalid) and valid [b, t, topk] bool,
    ordered by score (ties: lower key index first).
  """
  dims = _check_args(q_idx, w_idx, k_idx, q_pos, q_seg, k_pos, k_seg, topk, query_block, key_block)
  b, t, h, d, s = dims
  backend = resolve_backend(backend)
  interpret = resolve_interpret(interpret)
  if block is None:
    block = BlockSizes.default(backend)
  _need(isinstance(block, BlockSizes),
        f"pallas blockwise_topk: block must be a BlockSizes, got {type(block).__name__}.")
  geo = _geometry(dims, topk, key_block, block, backend, interpret)
  tp, sp, dp, m = geo.queries, geo.keys, geo.dim, geo.chunk
  sg = jax.lax.stop_gradient
  q = jnp.pad(sg(q_idx), ((0, 0), (0, tp - t), (0, 0), (0, dp - d))).transpose(0, 2, 1, 3)
  w = _pad1(sg(w_idx).astype(jnp.float32), tp, 0.0).transpose(0, 2, 1)[..., None]
  qp, qs = _pad1(q_pos.astype(jnp.int32), tp, 0), _pad1(q_seg.astype(jnp.int32), tp, -1)
  k = jnp.pad(sg(k_idx), ((0, 0), (0, sp - s), (0, dp - d)))
  kp, ks = _pad1(k_pos.astype(jnp.int32), sp, 0), _pad1(k_seg.astype(jnp.int32), sp, -1)
  bounds = tile_bounds(qp, qs, kp, ks, geo.block_q, geo.block_k)
  chunked = lambda x: x.reshape(b, sp // m, 1, m)
  vals, ids = kernel.topk(geo, bounds, q, w, qp[..., None], qs[..., None], k, chunked(kp), chunked(ks))
  flat = lambda x: x.transpose(0, 1, 3, 2, 4).reshape(b, tp, geo.slots)[:, :t, :topk]
  vals, ids = flat(vals), flat(ids)
  valid = vals > -jnp.inf
  return jnp.where(valid, ids, 0), valid
