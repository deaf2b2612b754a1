"""Public Pallas gated delta rule: a drop-in for model/attention/delta_rule.py:chunk_gated_delta_rule.

Gated DeltaNet (Yang, Kautz & Hatamizadeh, ICLR 2025) in the chunkwise WY/UT form (Yang et al.,
NeurIPS 2024). Same arguments and results as the XLA function, plus keyword-only `block`
(launch sizes) and `interpret`. The kernels (kernel.py) do the chunk maths and the sequential
state pass; this wrapper does the O(t) layout work in XLA: pad the sequence to whole chunks
(beta = 0, g = 0 tokens leave the state unchanged), move heads in front of time, take the
in-chunk cumulative log decay G and the in-chunk reset counters. Autodiff of those steps maps
the kernel's dG back to dg (the adjoint of the cumsum) and slices the padding off.

Backends: `interpret=None` runs the kernels in interpret mode on CPU and compiled elsewhere;
compiled code picks its kernel at lowering time with lax.platform_dependent, so one function
exports to both TPU and GPU:
  * TPU: Mosaic, grid (b, h, time blocks) with a sequential time axis; `block.time_block`
    bounds the VMEM held per step (default about 512 tokens).
  * GPU: the Triton backend of Pallas, one program per (batch, head) over the whole sequence
    (Triton grids are parallel, so the state cannot cross programs). Triton rather than Mosaic
    GPU: the kernel is a sequential recurrence of small (c x c, c x d) matmuls plus a masked
    substitution loop, which Triton compiles for any NVIDIA GPU from Ampere on without the
    warpgroup/TMA programming Mosaic GPU needs for Hopper-sized tiles; it is what the
    reference GPU implementation of this algorithm (flash-linear-attention) uses as well.
    Triton needs power-of-two tensor sizes, so head dims are zero-padded to a power of two
    (>= 16, tl.dot's minimum), which is exact: zero key columns add nothing to k.k and zero
    value columns give zero outputs.
Compiled kernels need chunk_size a power of two >= 16 (TPU sublane tiling, tl.dot minimum).

Shapes (no einsums here): [b, t, h, k] / [b, t, h, v] as in the model (b batch, t time,
h heads, k key dim, v value dim), [b, h, n, 1, c] for per-chunk rows (n chunks of c tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.backend import resolve_interpret
from pallas_kernels.common import as_python_ints, next_pow2, positive_int
from pallas_kernels.delta_rule import kernel
from pallas_kernels.delta_rule.reference import check_inputs as check_reference_inputs
from pallas_kernels.delta_rule.reference import initial_state_or_zeros as initial_or_zeros

_FN = "pallas chunk_gated_delta_rule"
_TPU_TIME_BLOCK_TOKENS = 512  # default tokens per TPU grid step (VMEM per step stays ~MiBs)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Launch sizes of the delta rule kernels.

  Attributes:
    time_block: tokens per sequential grid step on TPU and in interpret mode (a multiple of
      chunk_size; the sequence is padded to a whole number of blocks). None: the whole
      sequence in interpret mode, about 512 tokens on TPU. The GPU kernel always runs the
      whole sequence in one program.
    pad_head_dims: zero-pad kd and vd to powers of two (>= 16). None: only on GPU, where
      Triton needs it; True also elsewhere (interpret mode then runs the GPU layout).
    num_warps, num_stages: Triton launch parameters (GPU only).
  """
  time_block: int | None = None
  pad_head_dims: bool | None = None
  num_warps: int = 4
  num_stages: int = 1

  def __post_init__(self):
    tb = self.time_block
    if tb is not None and positive_int(tb) is None:
      raise ValueError(f"BlockSizes.time_block={self.time_block!r} must be a positive int "
                       "(a multiple of chunk_size) or None.")
    if self.pad_head_dims not in (None, True, False):
      raise ValueError(f"BlockSizes.pad_head_dims={self.pad_head_dims!r} must be None, True or False.")
    if positive_int(self.num_warps) not in (1, 2, 4, 8, 16, 32):
      raise ValueError(f"BlockSizes.num_warps={self.num_warps!r} must be a power of two in [1, 32].")
    if positive_int(self.num_stages) is None:
      raise ValueError(f"BlockSizes.num_stages={self.num_stages!r} must be a positive int.")
    as_python_ints(self, "time_block", "num_warps", "num_stages")


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static choices of one call (hashable: a nondiff argument of the custom_vjp)."""
  chunk: int
  time_block: int  # interpret / TPU; the GPU uses the whole padded length
  interpret: bool
  pad_head_dims: bool  # interpret / TPU; the GPU always pads
  num_warps: int
  num_stages: int


def _check_inputs(q, k, v, g, beta, initial_state, reset) -> None:
  """Raises a ValueError naming the offending argument and the expected shape or dtype."""
  check_reference_inputs(_FN, q, k, v, g, beta, initial_state, reset)
  named = (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state))
  for name, x in named:
    if x is not None and not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{_FN}: {name} has dtype {x.dtype}; expected a floating dtype.")
  if reset is not None and not (reset.dtype == jnp.bool_ or jnp.issubdtype(reset.dtype, jnp.integer)):
    raise ValueError(f"{_FN}: reset has dtype {reset.dtype}; expected bool (True starts a segment) "
                     "or an integer dtype (nonzero starts a segment).")


def _resolve_interpret(interpret) -> bool:
  """As the other kernels, but no pltpu.InterpretParams: the TPU body is never interpreted here."""
  if interpret is not None and not isinstance(interpret, bool):
    raise ValueError(f"{_FN}: interpret={interpret!r} must be None (interpret on CPU only), True "
                     "or False.")
  return resolve_interpret(interpret)


def _time_block(block: BlockSizes, interpret: bool, n: int, c: int) -> int:
  """Tokens per time block (a multiple of c); the sequence is then padded to whole blocks."""
  if block.time_block is not None:
    if block.time_block % c:
      raise ValueError(f"{_FN}: block.time_block={block.time_block} must be a multiple of "
                       f"chunk_size={c}.")
    return min(block.time_block, n * c)
  if interpret or n * c <= _TPU_TIME_BLOCK_TOKENS:
    return n * c
  blocks = math.ceil(n * c / _TPU_TIME_BLOCK_TOKENS)  # even split: at most `blocks` chunks of padding
  return math.ceil(n / blocks) * c


def _pad_last(x, *sizes):
  """Zero-pads the trailing len(sizes) dims of x up to `sizes`."""
  widths = [(0, 0)] * (x.ndim - len(sizes)) + [(0, s - d) for s, d in zip(sizes, x.shape[-len(sizes):],
                                                                           strict=True)]
  return jnp.pad(x, widths)


def _layout(plan: _Plan, backend: str, tp: int, kd: int, vd: int):
  """The kernel Layout and the head dims for one backend, padded to powers of two (>= 16) on Triton."""
  if backend == "triton":
    layout = kernel.Layout(plan.chunk, tp, "triton", plan.num_warps, plan.num_stages)
  else:
    layout = kernel.Layout(plan.chunk, plan.time_block, backend)
  if backend == "triton" or plan.pad_head_dims:
    return layout, next_pow2(kd, 16), next_pow2(vd, 16)
  return layout, kd, vd


def _forward_impl(plan: _Plan, backend: str, q, k, v, g, beta, seg, s0):
  kd, vd = q.shape[-1], v.shape[-1]
  layout, kp, vp = _layout(plan, backend, q.shape[2], kd, vd)
  o, final = kernel.forward(_pad_last(q, kp), _pad_last(k, kp), _pad_last(v, vp), g, beta, seg,
                            _pad_last(s0, kp, vp), layout)
  return o[..., :vd], final[..., :kd, :vd]


def _backward_impl(plan: _Plan, backend: str, q, k, v, g, beta, seg, s0, do, dfinal):
  kd, vd = q.shape[-1], v.shape[-1]
  layout, kp, vp = _layout(plan, backend, q.shape[2], kd, vd)
  qp, kp_, vp_ = _pad_last(q, kp), _pad_last(k, kp), _pad_last(v, vp)
  # Recompute the chunk-start states (one forward pass) instead of keeping them from the forward.
  states, _ = kernel.forward(qp, kp_, vp_, g, beta, seg, _pad_last(s0, kp, vp), layout,
                             emit_states=True)
  dq, dk, dv, dg, dbeta, ds0 = kernel.backward(qp, kp_, vp_, g, beta, seg, states,
                                               _pad_last(do, vp), _pad_last(dfinal, kp, vp), layout)
  return dq[..., :kd], dk[..., :kd], dv[..., :vd], dg, dbeta, ds0[..., :kd, :vd]


def _dispatch(plan: _Plan, impl, *args):
  """Interpret mode, or the TPU / GPU kernel chosen when the platform is known (lowering)."""
  if plan.interpret:
    return impl(plan, "interpret", *args)
  tpu = functools.partial(impl, plan, "tpu")
  gpu = functools.partial(impl, plan, "triton")
  # Other platforms (CPU with interpret=False) fall to Pallas's own error for a compiled kernel
  # there ("Only interpret mode is supported on CPU backend").
  return lax.platform_dependent(*args, tpu=tpu, cuda=gpu, rocm=gpu, default=tpu)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _delta(plan: _Plan, q, k, v, g, beta, seg, s0):
  """Kernel-layout delta rule: q, k [b, h, T, kd], ... -> o [b, h, T, vd], final [b, h, kd, vd]."""
  return _dispatch(plan, _forward_impl, q, k, v, g, beta, seg, s0)


def _delta_fwd(plan: _Plan, q, k, v, g, beta, seg, s0):
  # Residuals are the inputs only: the backward recomputes chunk states and intra-chunk terms.
  return _delta(plan, q, k, v, g, beta, seg, s0), (q, k, v, g, beta, seg, s0)


def _delta_bwd(plan: _Plan, res, cts):
  do, dfinal = cts
  dq, dk, dv, dg, dbeta, ds0 = _dispatch(plan, _backward_impl, *res, do, dfinal)
  return dq, dk, dv, dg, dbeta, jnp.zeros_like(res[5]), ds0


_delta.defvjp(_delta_fwd, _delta_bwd)


def _kernel_layout(x, tp: int):
  """[b, t, h, ...] f32 -> [b, h, tp, ...], zero-padded in time."""
  x = x.astype(jnp.float32)
  x = jnp.pad(x, [(0, 0), (0, tp - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
  return jnp.swapaxes(x, 1, 2)


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, reset=None, chunk_size: int = 64,
                           *, block: BlockSizes | None = None, interpret: bool | None = None):
  """Chunkwise gated delta rule with Pallas kernels (forward and backward).

  Args:
    q, k: [b, t, h, kd] (already L2-normalised; q already scaled).
    v: [b, t, h, vd].
    g: [b, t, h] log-decay (<= 0); a_t = exp(g_t).
    beta: [b, t, h] write strength.
    initial_state: [b, h, kd, vd] or None (zeros).
    reset: [b, t] bool or None; True zeroes the state before token t.
    chunk_size: tokens per chunk.
    block: launch sizes (BlockSizes); None for the defaults.
    interpret: None (interpret mode on CPU, compiled kernels on TPU/GPU), True or False.

  Returns:
    o [b, t, h, vd] in v's dtype, final state [b, h, kd, vd] in float32; differentiable in
    q, k, v, g, beta and initial_state.
  """
  _check_inputs(q, k, v, g, beta, initial_state, reset)
  if positive_int(chunk_size) is None:
    raise ValueError(f"{_FN}: chunk_size={chunk_size!r} must be a positive int.")
  chunk_size = int(chunk_size)
  block = BlockSizes() if block is None else block
  if not isinstance(block, BlockSizes):
    raise ValueError(f"{_FN}: block={block!r} must be a BlockSizes or None.")
  interp = _resolve_interpret(interpret)
  c = chunk_size
  if not interp and (c < 16 or c & (c - 1)):
    raise ValueError(f"{_FN}: chunk_size={c} must be a power of two >= 16 for the compiled kernels "
                     "(TPU tiling, Triton tl.dot); use interpret=True for other sizes.")
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  if 0 in (b, h, kd, vd):  # nothing to compute, and the kernels' grids and tiles need every axis
    return jnp.zeros((b, t, h, vd), v.dtype), initial_or_zeros(initial_state, b, h, kd, vd, jnp.float32)
  tb = _time_block(block, interp, max(1, math.ceil(t / c)), c)
  tp = max(1, math.ceil(t / tb)) * tb
  n = tp // c
  plan = _Plan(c, tb, interp, bool(block.pad_head_dims), block.num_warps, block.num_stages)
  rows = _kernel_layout(jnp.stack([g, beta], axis=-1), tp).reshape(b, h, n, 1, c, 2)
  g_cum = jnp.cumsum(rows[..., 0], axis=-1)  # G: in-chunk cumulative log decay
  resets = jnp.zeros((b, t), bool) if reset is None else reset.astype(bool)
  resets = jnp.pad(resets, ((0, 0), (0, tp - t))).reshape(b, n, 1, c)
  seg = jnp.cumsum(resets.astype(jnp.int32), axis=-1).astype(jnp.float32)
  s0 = initial_or_zeros(initial_state, b, h, kd, vd, jnp.float32)
  o, final = _delta(plan, _kernel_layout(q, tp), _kernel_layout(k, tp), _kernel_layout(v, tp),
                    g_cum, rows[..., 1], seg, s0)
  return jnp.swapaxes(o[:, :, :t], 1, 2).astype(v.dtype), final
