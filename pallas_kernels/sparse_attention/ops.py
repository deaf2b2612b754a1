"""Public Pallas top-k sparse MQA: a drop-in for model.attention.sparse.sparse_mqa_attention.

Same signature and results as the XLA path (DeepSeek-V3.2-Exp DSA main
attention in absorbed-MLA MQA form, see kernel.py), plus keyword-only
`block` (BlockSizes), `interpret` and `backend`. The XLA path gathers a
[query_block, k, c] slab per query block and lets autodiff scatter its
gradient; the kernels keep one block of J gathered rows in fast memory and
fuse logits, online softmax and the value sum (forward) and the
probability recomputation and all four gradients (backward).

Backend choice (`backend=None`): "tpu" on a TPU (Mosaic, DMA gathers),
otherwise "triton" (GPU; on CPU its interpret mode, which is the faster of
the two interpreters). `interpret=None` interprets on CPU and compiles on
TPU/GPU. Either body can be forced for tests (`backend="tpu",
interpret=True` runs the TPU body under pltpu.InterpretParams).

`query_block` keeps its meaning as a memory bound: on TPU the backward pass
handles query_block queries at a time (their per-slot key-gradient rows are
scatter-added by XLA, see kernel.py), so no more than one chunk's
[query_block, k, c] rows exist at once, as in the XLA path. The Triton
backward scatters with atomics and needs no chunking.

p_sel (the head-summed, normalised probabilities that feed the indexer's
KL loss) carries no gradient in the XLA path either (indexer_kl
stop_gradients it); here it comes from a separate kernel that recomputes the
probabilities from the forward pass's log-sum-exp, so decode steps that
discard it do not pay for it (the call is dead code then).
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.backend import resolve_backend, resolve_interpret
from pallas_kernels.common import as_python_ints as _as_python_ints
from pallas_kernels.common import is_pow2 as _pow2
from pallas_kernels.common import need as _need
from pallas_kernels.common import next_pow2 as _next_pow2
from pallas_kernels.common import positive_int as _positive_int
from pallas_kernels.common import round_up as _round_up
from pallas_kernels.sparse_attention import kernel
from pallas_kernels.sparse_attention.reference import check_mqa_args

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the sparse-attention kernels.

  Attributes:
    block_q: queries per grid step (looped inside the step). TPU needs a
      multiple of 8 unless one tile covers all queries.
    block_k: selected slots gathered and processed together (J).
    block_h: heads per grid step; None = all heads (required by the TPU
      backward, whose per-slot key-gradient rows sum over all heads).
  """
  block_q: int = 8
  block_k: int = 128
  block_h: int | None = None

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      val = getattr(self, name)
      if not _pow2(val):
        raise ValueError(f"BlockSizes.{name}={val!r} must be a positive power of two.")
    if self.block_h is not None and not _pow2(self.block_h):
      raise ValueError(f"BlockSizes.block_h={self.block_h!r} must be None (all heads) or a power of two.")
    _as_python_ints(self, "block_q", "block_k", "block_h")

  @classmethod
  def default(cls, backend: str) -> "BlockSizes":
    """Starting points, not tuned on hardware (no TPU/GPU run yet).

    TPU: 8 queries x 128 slots (lane-dense), all heads. Triton: one query per
    program (most parallelism: queries are independent) x 32 slots, 32 heads
    per program (a [32, c] f32 accumulator stays in registers for c <= 512).
    """
    return cls(8, 128, None) if backend == "tpu" else cls(1, 32, 32)


def _check_args(q_lat, q_rope, latent, k_rope, idx, valid, scale, query_block):
  fn = "pallas sparse_mqa_attention"
  b, t, h, s = check_mqa_args(fn, q_lat, q_rope, latent, k_rope)  # shared with the XLA path
  c = q_lat.shape[3]
  _need(0 not in q_lat.shape and s > 0,
        f"{fn}: need non-empty q_lat and latent (at least one query, head and key), got "
        f"{q_lat.shape} and {latent.shape}.")
  _need(idx.ndim == 3 and idx.shape[:2] == (b, t) and valid.shape == idx.shape and idx.shape[2] > 0,
        f"{fn}: idx and valid must both be [b={b}, t={t}, topk >= 1], got {idx.shape} and {valid.shape}.")
  _need(jnp.issubdtype(idx.dtype, jnp.integer), f"{fn}: idx must be an integer array, got {idx.dtype}.")
  _need(_positive_int(query_block) is not None,
        f"{fn}: query_block={query_block!r} must be a positive int.")
  _need(isinstance(scale, numbers.Real) and not isinstance(scale, bool) and 0 < scale < float("inf"),
        f"{fn}: scale={scale!r} must be a positive number.")
  return b, t, h, s, c, q_rope.shape[3], idx.shape[2]


def _geometry(dims, scale, query_block, block: BlockSizes, backend: str, interpret):
  """Padded sizes for the chosen backend, and the TPU backward's query chunk."""
  b, t, h, s, c, p, k = dims
  fn = "pallas sparse_mqa_attention"
  if backend == "triton":  # Triton: power-of-two tiles, dots need every dim >= 16
    hp, cp, pp, bk = _next_pow2(h, 16), _next_pow2(c, 16), _next_pow2(p, 16), max(block.block_k, 16)
  else:
    hp, cp, pp, bk = h, c, p, block.block_k
  hb = hp if block.block_h is None else min(block.block_h, hp)
  if backend == "triton":
    hb = max(hb, 16)
  # Fewer queries than a tile (decode, short prefill): one tile of exactly t
  # queries, no padded queries to gather for (TPU allows a block equal to the
  # full dimension; Triton needs a power of two).
  bq = min(block.block_q, t if backend == "tpu" else _next_pow2(t))
  chunk = bq * max(1, min(query_block, t) // bq) if backend == "tpu" else bq
  tp = _round_up(t, chunk)
  if backend == "tpu":
    _need(bq % 8 == 0 or tp == bq, f"{fn}: on TPU block_q={bq} must be a multiple of 8 (or cover all "
          f"{t} queries in one tile); use BlockSizes(block_q=8).")
    _need(hb == hp or hb % 8 == 0, f"{fn}: on TPU block_h={hb} must be a multiple of 8 or all {h} heads.")
  _need(hp % hb == 0, f"{fn}: block_h={hb} must divide the (padded) head count {hp}.")
  geo = kernel.Geometry(batch=b, queries=tp, keys=s, heads=hp, real_heads=h, latent=cp, rope=pp,
                        slots=_round_up(k, bk), block_q=bq, block_k=bk, block_h=hb, scale=float(scale),
                        backend=backend, interpret=interpret)
  return geo, chunk


def _pad_to(x, shape, value=0):
  return jnp.pad(x, [(0, n - m) for n, m in zip(shape, x.shape, strict=True)], constant_values=value)


def _backward_tpu_chunked(geo: kernel.Geometry, chunk: int, q_lat, q_rope, latent, k_rope, sel, mask,
                          do, lse, dd):
  """TPU backward one query chunk at a time: kernel -> per-slot rows -> XLA scatter-add."""
  b, tp, s = geo.batch, geo.queries, geo.keys
  n = tp // chunk
  geo_c = dataclasses.replace(geo, queries=chunk)
  split = lambda x: jnp.moveaxis(x.reshape((b, n, chunk) + x.shape[2:]), 1, 0)
  rows_b = jnp.arange(b)[:, None]

  def body(acc, xs):
    ql, qr, sl, mk, d_o, ls, d_d = xs
    dql, dqr, rl, rk = kernel.backward(geo_c, ql, qr, latent, k_rope, sl, mk, d_o, ls, d_d)
    flat = sl.reshape(b, -1)
    ok = (flat >= 0)[..., None]
    dst = jnp.where(flat >= 0, flat, 0)
    dlat = acc[0].at[rows_b, dst].add(jnp.where(ok, rl.reshape(b, flat.shape[1], -1), 0.0))
    dkr = acc[1].at[rows_b, dst].add(jnp.where(ok, rk.reshape(b, flat.shape[1], -1), 0.0))
    return (dlat, dkr), (dql, dqr)

  init = (jnp.zeros((b, s, geo.latent), _F32), jnp.zeros((b, s, geo.rope), _F32))
  xs = tuple(split(x) for x in (q_lat, q_rope, sel, mask, do, lse, dd))
  (dlat, dkr), (dql, dqr) = jax.lax.scan(body, init, xs)
  merge = lambda x: jnp.moveaxis(x, 0, 1).reshape((b, tp) + x.shape[3:])
  return merge(dql), merge(dqr), dlat, dkr


def _attention_fn(geo: kernel.Geometry, chunk: int):
  """custom_vjp over padded arrays: (q_lat, q_rope, latent, k_rope, sel, mask) -> (out, lse)."""

  @jax.custom_vjp
  def attn(q_lat, q_rope, latent, k_rope, sel, mask):
    return kernel.forward(geo, q_lat, q_rope, latent, k_rope, sel, mask)

  def fwd(q_lat, q_rope, latent, k_rope, sel, mask):
    out, lse = kernel.forward(geo, q_lat, q_rope, latent, k_rope, sel, mask)
    return (out, lse), (q_lat, q_rope, latent, k_rope, sel, mask, out, lse)

  def bwd(res, cts):
    q_lat, q_rope, latent, k_rope, sel, mask, out, lse = res
    d_out, d_lse = cts
    # dlogit = p * (dp - D) with D = rowsum(dO * O); an lse cotangent adds p * dlse.
    dd = jnp.sum(d_out.astype(_F32) * out.astype(_F32), axis=-1, keepdims=True) - d_lse
    dd = jnp.where(jnp.isfinite(lse), dd, 0.0)
    d_out = d_out.astype(q_lat.dtype)
    if geo.backend == "tpu":
      dql, dqr, dlat, dkr = _backward_tpu_chunked(geo, chunk, q_lat, q_rope, latent, k_rope, sel, mask,
                                                  d_out, lse, dd)
    else:
      dql, dqr, dlat, dkr = kernel.backward(geo, q_lat, q_rope, latent, k_rope, sel, mask, d_out, lse, dd)
    return (dql.astype(q_lat.dtype), dqr.astype(q_rope.dtype), dlat.astype(latent.dtype),
            dkr.astype(k_rope.dtype), None, None)

  attn.defvjp(fwd, bwd)
  return attn


def sparse_mqa_attention(q_lat: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array,
                         idx: jax.Array, valid: jax.Array, scale: float, query_block: int, *,
                         block: BlockSizes | None = None,
                         interpret: bool | pltpu.InterpretParams | None = None,
                         backend: str | None = None) -> tuple[jax.Array, jax.Array]:
  """MQA over the selected latent rows, as Pallas kernels (drop-in for the XLA path).

  logit[t,h,j] = scale * (q_lat[t,h] . latent[idx[t,j]] + q_rope[t,h] . k_rope[idx[t,j]]),
  softmax over the valid slots in f32, out[t,h] = sum_j p * latent[idx[t,j]].
  Out-of-range indices are clipped (like the XLA path's gather).

  Args:
    q_lat: [b, t, h, c] absorbed queries.
    q_rope: [b, t, h, p] RoPE'd query part.
    latent: [b, s, c] per-token latent.
    k_rope: [b, s, p] per-token RoPE key.
    idx: [b, t, j] int selected key indices; valid: [b, t, j] bool.
    scale: softmax scale.
    query_block: queries per backward chunk on TPU (a memory bound; see module doc).
    block: kernel tile sizes (default: BlockSizes.default(backend)).
    interpret: run the kernels in interpret mode (None: on CPU only); True uses
      the backend's interpreter (TPU: pltpu.InterpretParams()), or pass
      explicit pltpu.InterpretParams for the TPU body.
    backend: "tpu" or "triton" (None: by the default JAX backend).

  Returns:
    out_lat [b, t, h, c] in q_lat's dtype (zero for a row with no valid slot)
    and p_sel [b, t, j] f32, the head-summed probabilities normalised to sum 1
    (no gradient).
  """
  dims = _check_args(q_lat, q_rope, latent, k_rope, idx, valid, scale, query_block)
  b, t, h, s, c, p, k = dims
  backend = resolve_backend(backend)
  interpret = resolve_interpret(interpret)
  if block is None:
    block = BlockSizes.default(backend)
  _need(isinstance(block, BlockSizes), f"pallas sparse_mqa_attention: block must be a BlockSizes, "
        f"got {type(block).__name__}.")
  geo, chunk = _geometry(dims, scale, query_block, block, backend, interpret)
  tp, hp, cp, pp, kp = geo.queries, geo.heads, geo.latent, geo.rope, geo.slots
  dtype = q_lat.dtype
  sel = jnp.where(valid.astype(bool), jnp.clip(idx, 0, s - 1), -1).astype(jnp.int32)
  sel = _pad_to(sel, (b, tp, kp), -1)
  mask = sel.reshape(b, tp, geo.n_slot_blocks, 1, geo.block_k)
  ql = _pad_to(q_lat, (b, tp, hp, cp))
  qr = _pad_to(q_rope, (b, tp, hp, pp))
  lat = _pad_to(latent.astype(dtype), (b, s, cp))
  kr = _pad_to(k_rope.astype(q_rope.dtype), (b, s, pp))
  out, lse = _attention_fn(geo, chunk)(ql, qr, lat, kr, sel, mask)
  sg = jax.lax.stop_gradient
  p_blocks = kernel.probs(geo, sg(ql), sg(qr), sg(lat), sg(kr), sel, mask, sg(lse))
  p_sel = jnp.sum(p_blocks, axis=1).reshape(b, tp, kp)[:, :t, :k]
  return out[:, :t, :h, :c].astype(dtype), p_sel
