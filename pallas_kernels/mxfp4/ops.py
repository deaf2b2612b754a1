"""Public MXFP4 matmuls: shape checks, block sizes, custom VJP, backend choice.

`mxfp4_matmul(x, blocks, scales)` = x @ W^T and `mxfp4_ragged_matmul(x, blocks,
scales, group_sizes)` = `lax.ragged_dot` with MXFP4 right-hand sides, where the
weights stay in the gpt-oss layout (format.py) and are dequantized tile by tile
inside the Pallas kernel (kernel.py), never materialised densely. The results
equal `reference.py` (dequantize + XLA matmul) up to f32 summation order.

Weights are frozen in MXFP4 (there is no useful gradient for 4-bit codes), so
the custom VJP returns the gradient w.r.t. x only: dx = dy @ W, computed by a
second kernel over the same tiles; blocks, scales and group_sizes get none.

Backends: `interpret=None` runs interpret mode on CPU and compiles on TPU/GPU;
`backend=None` uses the Triton ('gpu') grid strategy on GPUs and the Mosaic
('tpu') one elsewhere -- pass backend='tpu'/'gpu' to pick one explicitly (e.g.
to export for another platform from a CPU host, or to test both in interpret
mode). See kernel.py for the two strategies.

Using it for the MoE experts (model/moe.py): quantize w_gate / w_up [e, d, f]
with `format.quantize(w, axis=1)` -> blocks [e, f, d/32, 16], and w_down
[e, f, d] with `quantize(w_down, axis=1)` -> [e, d, f/32, 16]; then
`mxfp4_ragged_matmul(xs, blocks, scales, group_sizes)` replaces
`lax.ragged_dot(xs, w, group_sizes)` for sorted rows xs.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.common import as_python_ints, positive_int
from pallas_kernels.mxfp4 import kernel
from pallas_kernels.mxfp4.format import BLOCK, check_mxfp4


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes: rows of x, output features, contraction elements (K, not bytes).

  A size at least the array's dimension means "the whole dimension". Compiled
  TPU tiles smaller than the array need block_m % 8, block_n % 128 and
  block_k % 256 == 0 (Mosaic's (8, 128) tiling of x, the codes and the
  transposed scales); compiled GPU (Triton) tiles must be powers of two with
  block_m, block_n >= 16. Interpret mode accepts any multiple of 32 for block_k.
  `for_backend` gives the defaults used when `block=None`.
  """
  block_m: int = 128
  block_n: int = 128
  block_k: int = 512

  def __post_init__(self):
    for name in ("block_m", "block_n", "block_k"):
      value = getattr(self, name)
      if positive_int(value) is None:
        raise ValueError(f"BlockSizes.{name}={value!r} must be a positive int.")
    as_python_ints(self, "block_m", "block_n", "block_k")
    if self.block_k % BLOCK:
      raise ValueError(f"BlockSizes.block_k={self.block_k} must be a multiple of {BLOCK} (whole "
                       "MXFP4 blocks per tile); e.g. 512.")

  @classmethod
  def for_backend(cls, backend: str) -> "BlockSizes":
    """Defaults: TPU tiles of 1024 contraction elements (32 scale rows: a full uint8
    (32, 128) tile of the transposed scales); Triton tiles of 128 (two 64-deep
    dots per step), whose dequantized [64, 64] planes stay in registers."""
    return cls(128, 128, 1024) if backend == "tpu" else cls(64, 64, 128)


def _pow2_at_least(x: int, lo: int) -> int:
  return max(lo, 1 << (max(x, 1) - 1).bit_length())


def _check_tpu_tiles(bm, bn, bk, m, n, k):
  rules = (("block_m", bm, m, 8), ("block_n", bn, n, 128), ("block_k", bk, k, 256))
  for name, b, dim, mult in rules:
    if b != dim and b % mult:
      raise ValueError(f"mxfp4 (TPU): BlockSizes.{name}={b} must be a multiple of {mult} or at "
                       f"least the dimension ({dim}) for Mosaic's (8, 128) tiling.")


def _check_gpu_tiles(bm, bn, bk):
  for name, b, lo in (("block_m", bm, 16), ("block_n", bn, 16), ("block_k", bk, 32)):
    if b < lo or b & (b - 1):
      raise ValueError(f"mxfp4 (GPU/Triton): BlockSizes.{name}={b} must be a power of two >= {lo} "
                       "(Triton tensors have power-of-two sizes).")


def _tile_sizes(block: BlockSizes, backend: str, m: int, n: int, k: int,
                interpret: bool) -> tuple[int, int, int]:
  if backend == "tpu":
    bm, bn, bk = (min(block.block_m, m), min(block.block_n, n), min(block.block_k, k))
    if not interpret:
      _check_tpu_tiles(bm, bn, bk, m, n, k)
    return bm, bn, bk
  bm = min(block.block_m, _pow2_at_least(m, 16))
  bn = min(block.block_n, _pow2_at_least(n, 16))
  bk = min(block.block_k, _pow2_at_least(k, 32))
  if not interpret:
    _check_gpu_tiles(bm, bn, bk)
  return bm, bn, bk


def _resolve(backend: str | None, interpret: bool | None) -> tuple[str, bool]:
  platform = jax.default_backend()
  if backend is None:
    backend = "gpu" if platform == "gpu" else "tpu"
  if backend not in kernel.BACKENDS:
    raise ValueError(f"mxfp4: backend={backend!r}; choose one of {kernel.BACKENDS} or None (auto).")
  if interpret is None:
    interpret = platform not in ("tpu", "gpu")
  return backend, bool(interpret)


@dataclasses.dataclass(frozen=True)
class _Call:
  backend: str
  interpret: bool
  fwd: kernel.Static
  bwd: kernel.Static


def _forward(call: _Call, x2, blocks, scales, group_sizes):
  xp = kernel.split_parity(x2)
  return kernel.ragged_forward(xp, blocks, scales, group_sizes, call.fwd, call.backend,
                               call.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged(call: _Call, x2, blocks, scales, group_sizes):
  return _forward(call, x2, blocks, scales, group_sizes)


def _ragged_fwd(call: _Call, x2, blocks, scales, group_sizes):
  return _forward(call, x2, blocks, scales, group_sizes), (blocks, scales, group_sizes)


def _ragged_bwd(call: _Call, res, dy):
  blocks, scales, group_sizes = res
  dxp = kernel.ragged_backward(dy, blocks, scales, group_sizes, call.bwd, call.backend,
                               call.interpret)
  return kernel.merge_parity(dxp), None, None, None


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


def _check_x(x: jax.Array, k: int, where: str) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{where}: x must be a float array (f32/bf16/f16); got {x.dtype}.")
  if x.shape[-1] != k:
    raise ValueError(f"{where}: x's last axis has {x.shape[-1]} elements but the weights contract "
                     f"over K = blocks.shape[-2] * 32 = {k}; quantize the weight along x's feature "
                     "axis (format.quantize(w, axis=<contraction axis>)).")


def _make_call(x2, n, k, groups, preferred_element_type, block, interpret, backend) -> _Call:
  backend, interpret = _resolve(backend, interpret)
  m = x2.shape[0]
  bm, bn, bk = _tile_sizes(block or BlockSizes.for_backend(backend), backend, m, n, k, interpret)
  out_dtype = jnp.dtype(preferred_element_type or x2.dtype)
  x_dtype = jnp.dtype(x2.dtype)
  common = dict(m=m, n=n, k2=k // 2, groups=groups, bm=bm, bn=bn, bk2=bk // 2)
  fwd = kernel.Static(**common, dtype=x_dtype.name, out_dtype=out_dtype.name)
  bwd_dtype = jnp.promote_types(x_dtype, out_dtype)  # dy arrives in out_dtype
  bwd = kernel.Static(**common, dtype=bwd_dtype.name, out_dtype=x_dtype.name)
  return _Call(backend=backend, interpret=interpret, fwd=fwd, bwd=bwd)


def mxfp4_ragged_matmul(x: jax.Array, blocks: jax.Array, scales: jax.Array, group_sizes: jax.Array,
                        *, preferred_element_type=None, block: BlockSizes | None = None,
                        interpret: bool | None = None, backend: str | None = None) -> jax.Array:
  """Grouped matmul with MXFP4 weights: `lax.ragged_dot(x, W, group_sizes)`.

  Args:
    x: [M, K] float rows sorted by group (group g owns the next group_sizes[g]
      rows); rows past sum(group_sizes) (which must be <= M) give zeros.
    blocks: uint8 [G, N, K/32, 16], W_g's codes with K (contraction) blocked.
    scales: uint8 [G, N, K/32] E8M0 bytes.
    group_sizes: int [G] rows per group.
    preferred_element_type: result dtype (default x.dtype); accumulation is f32.
    block: BlockSizes (default `BlockSizes.for_backend(backend)`).
    interpret: None = interpret mode on CPU only.
    backend: 'tpu' | 'gpu' kernel strategy; None = 'gpu' on GPUs, else 'tpu'.

  Returns:
    [M, N]: y[r] = x[r] @ dequantize(W_g)^T for the group g of row r.
  """
  x, blocks, scales = jnp.asarray(x), jnp.asarray(blocks), jnp.asarray(scales)
  group_sizes = jnp.asarray(group_sizes)
  check_mxfp4(blocks, scales, "mxfp4_ragged_matmul")
  if blocks.ndim != 4 or blocks.shape[0] < 1:
    raise ValueError(f"mxfp4_ragged_matmul: blocks must be [groups >= 1, N, K/32, 16]; got shape "
                     f"{blocks.shape} (use mxfp4_matmul for one weight matrix).")
  g, n, k32, _ = blocks.shape
  if x.ndim != 2:
    raise ValueError(f"mxfp4_ragged_matmul: x must be [M, K]; got shape {x.shape} (flatten first).")
  _check_x(x, k32 * BLOCK, "mxfp4_ragged_matmul")
  if group_sizes.shape != (g,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"mxfp4_ragged_matmul: group_sizes must be an int array of shape ({g},) (one "
                     f"size per weight group); got {group_sizes.dtype}{list(group_sizes.shape)}.")
  out_dtype = preferred_element_type or x.dtype
  if x.shape[0] == 0 or n == 0 or k32 == 0:  # empty: the kernels' tiles need every axis
    return jnp.zeros((x.shape[0], n), out_dtype)
  call = _make_call(x, n, k32 * BLOCK, g, preferred_element_type, block, interpret, backend)
  return _ragged(call, x, blocks, scales, group_sizes.astype(jnp.int32))


def mxfp4_matmul(x: jax.Array, blocks: jax.Array, scales: jax.Array, *,
                 preferred_element_type=None, block: BlockSizes | None = None,
                 interpret: bool | None = None, backend: str | None = None) -> jax.Array:
  """x @ W^T with W [N, K] stored in MXFP4 (one group of `mxfp4_ragged_matmul`).

  Args:
    x: [..., K] float.
    blocks: uint8 [N, K/32, 16].
    scales: uint8 [N, K/32].
    preferred_element_type, block, interpret, backend: as `mxfp4_ragged_matmul`.

  Returns:
    [..., N].
  """
  x, blocks, scales = jnp.asarray(x), jnp.asarray(blocks), jnp.asarray(scales)
  check_mxfp4(blocks, scales, "mxfp4_matmul")
  if blocks.ndim != 3:
    raise ValueError(f"mxfp4_matmul: blocks must be [N, K/32, 16]; got shape {blocks.shape} (use "
                     "mxfp4_ragged_matmul for stacked per-group weights).")
  if x.ndim < 1:
    raise ValueError("mxfp4_matmul: x must have a feature axis [..., K]; got a scalar.")
  _check_x(x, blocks.shape[1] * BLOCK, "mxfp4_matmul")
  x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # not -1: K may be 0
  y = mxfp4_ragged_matmul(x2, blocks[None], scales[None], jnp.array([x2.shape[0]], jnp.int32),
                          preferred_element_type=preferred_element_type, block=block,
                          interpret=interpret, backend=backend)
  return y.reshape(*x.shape[:-1], blocks.shape[0])
