"""MoE experts: routed SwiGLU experts computed dropless, as grouped matmuls.

Experts are SwiGLU (DeepSeekMoE, Dai et al., 2024, arXiv:2401.06066),
computed *dropless*: every token-assignment is computed, no capacity factor
drops tokens. Assignments are sorted by expert (stable), so each expert owns a
contiguous run of rows, and the runs are multiplied by their expert's weights.
Four implementations compute the same function:

* 'grouped' (model/moe_grouped.py): a loop over expert-aligned row tiles with
  the expert's weights sliced in place and a custom VJP that accumulates dW per
  expert; no copy of an expert's weights per block. The training path on CPU.
* 'gather': for few assignments (decode), gathers the t*k selected experts'
  weights ([t*k, d, f], reading only those bytes) and runs one matrix-vector
  product per assignment.
* 'ragged_dot': `jax.lax.ragged_dot` with the per-expert group sizes. On TPU
  and GPU it lowers to XLA's native ragged dot. On XLA:CPU (jax 0.10) JAX lowers
  it to a *masked dense* dot over all groups ([e, rows, d] operand), which costs
  `num_experts` times the grouped FLOPs -- more than running every expert on
  every token.
* 'blocked': each expert's run is padded to a multiple of `block` rows and a
  batched matmul multiplies each block by a gathered copy of its expert's
  weights ([blocks, d, f] per weight, scatter-added back in the backward). Kept
  as the baseline the benchmark compares 'grouped' with.

`impl='auto'` picks 'gather' when t * k < e (fewer weight bytes than reading
every expert once, on any backend), else 'ragged_dot' on TPU/GPU and 'grouped'
elsewhere (`resolve_impl`).
`dense_experts_reference` runs every expert on every token and masks: the plain
reference all are tested against. `mxfp4_dropless_experts` is the same
computation with MXFP4 expert weights read by the fused Pallas grouped matmul
(pallas_kernels/mxfp4, OCP Microscaling Formats (MX) v1.0).

These functions run on one device; sharding/expert_parallel.py wraps them for
expert parallelism.

Einsum legend: t token, d model dim, e expert, f expert FFN width, j routed
slot (one of the top-k), n row block, m row within a block, a assignment.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from model.layers import einsum
from model.moe_grouped import grouped_swiglu

IMPLS = ("auto", "grouped", "gather", "ragged_dot", "blocked")


def _check_expert_args(x_td, expert_idx_tk, weights_tk, w_gate, w_up, w_down) -> None:
  if x_td.ndim != 2:
    raise ValueError(f"x_td must be [tokens, d_model]; got shape {x_td.shape} (flatten batch first).")
  t, d = x_td.shape
  if expert_idx_tk.ndim != 2 or expert_idx_tk.shape[0] != t:
    raise ValueError(f"expert_idx_tk must be [tokens={t}, k]; got shape {expert_idx_tk.shape}.")
  if weights_tk.shape != expert_idx_tk.shape:
    raise ValueError(f"weights_tk shape {weights_tk.shape} != expert_idx_tk shape "
                     f"{expert_idx_tk.shape}.")
  if w_gate.ndim != 3 or w_gate.shape[1] != d:
    raise ValueError(f"w_gate must be [experts, d_model={d}, ffn]; got shape {w_gate.shape}.")
  e, _, f = w_gate.shape
  if w_up.shape != (e, d, f):
    raise ValueError(f"w_up shape {w_up.shape} != w_gate shape {(e, d, f)}.")
  if w_down.shape != (e, f, d):
    raise ValueError(f"w_down shape {w_down.shape} != (experts, ffn, d_model) = {(e, f, d)}.")


def resolve_impl(impl: str, assignments: int, num_experts: int) -> str:
  """The implementation `impl` runs for `assignments` = t * k rows over `num_experts` experts.

  'auto': 'gather' when assignments < num_experts (it reads assignments expert
  slices, fewer bytes than every expert once), else 'ragged_dot' on TPU/GPU and
  'grouped' on other backends.
  """
  if impl not in IMPLS:
    raise ValueError(f"dropless_experts: impl={impl!r}; choose one of {IMPLS}.")
  if impl != "auto":
    return impl
  if assignments < num_experts:
    return "gather"
  return "ragged_dot" if jax.default_backend() in ("tpu", "gpu") else "grouped"


def default_block(rows: int, num_experts: int) -> int:
  """Rows per block for the 'blocked' path: ~rows per expert, a power of 2 in [8, 128]."""
  per_expert = max(1, -(-rows // num_experts))
  return int(min(128, max(8, 1 << (per_expert - 1).bit_length())))


def _sort_assignments(expert_idx_tk: jax.Array, num_experts: int):
  """Assignments a = token * k + slot sorted by expert (stable): (flat ids, order, group sizes)."""
  flat_e = expert_idx_tk.reshape(-1).astype(jnp.int32)
  order = jnp.argsort(flat_e, stable=True).astype(jnp.int32)
  group_sizes = jnp.bincount(flat_e, length=num_experts).astype(jnp.int32)
  return flat_e, order, group_sizes


def _grouped_swiglu(x_td, order, kslots, matmul, w_gate, w_up, w_down):
  """SwiGLU of the rows sorted by expert with a grouped `matmul(rows, w)`; [t*k, d] in assignment order.

  Rows of id e ("no expert") sort last, outside every group: grouped matmuls
  (lax.ragged_dot, the MXFP4 kernel) give them zeros.
  """
  rows = order.shape[0]
  xs = x_td[order // kslots]  # [rows, d], sorted by expert
  h = jax.nn.silu(matmul(xs, w_gate)) * matmul(xs, w_up)
  ys = matmul(h, w_down)
  inverse = jnp.zeros((rows,), jnp.int32).at[order].set(jnp.arange(rows, dtype=jnp.int32))
  return ys[inverse]


def _ragged_dot(group_sizes, dtype):
  def rdot(a, w):
    return jax.lax.ragged_dot(a.astype(dtype), w.astype(dtype), group_sizes,
                              preferred_element_type=jnp.float32).astype(dtype)
  return rdot


def _blocked_swiglu(x_td, order, sorted_e, group_sizes, kslots, w_gate, w_up, w_down, dtype, block):
  """SwiGLU with expert runs padded to `block` rows; returns [t*k, d] in assignment order."""
  t, d = x_td.shape
  rows = order.shape[0]
  e = w_gate.shape[0]
  num_blocks = (rows + e * (block - 1)) // block  # static bound on sum(ceil(size / block))
  padded = (group_sizes + block - 1) // block * block
  start = jnp.cumsum(group_sizes) - group_sizes
  pad_start = jnp.cumsum(padded) - padded
  r = jnp.arange(rows, dtype=jnp.int32)
  se = jnp.minimum(sorted_e, e - 1)
  dest = pad_start[se] + r - start[se]  # padded slot of the r-th sorted row
  # Padded slots read token t, an all-zero row appended to x.
  skip = sorted_e >= e  # "no expert" rows (expert parallelism's empty slots) get no slot
  dest = jnp.where(skip, num_blocks * block, dest)
  slot_token = jnp.full((num_blocks * block,), t, jnp.int32).at[dest].set(order // kslots, mode="drop")
  x_pad = jnp.concatenate([x_td, jnp.zeros((1, d), x_td.dtype)], axis=0)
  xb = x_pad[slot_token].reshape(num_blocks, block, d)
  block_end = jnp.cumsum(padded) // block  # [e]
  block_expert = jnp.minimum(
      jnp.searchsorted(block_end, jnp.arange(num_blocks), side="right"), e - 1)
  g = einsum("nmd,ndf->nmf", xb, w_gate[block_expert], dtype)
  u = einsum("nmd,ndf->nmf", xb, w_up[block_expert], dtype)
  yb = einsum("nmf,nfd->nmd", jax.nn.silu(g) * u, w_down[block_expert], dtype)
  slot = jnp.zeros((rows,), jnp.int32).at[order].set(dest)
  yb = jnp.concatenate([yb.reshape(num_blocks * block, d), jnp.zeros((1, d), yb.dtype)])
  return yb[slot]


def _gather_swiglu(x_td, expert_idx_tk, w_gate, w_up, w_down, dtype):
  """SwiGLU of each assignment with its own expert's gathered weights; [t*k, d] in assignment order.

  Reads only the t*k selected [d, f] slices per weight. Id e ("no expert") reads
  expert e-1 and is zeroed.
  """
  t, kslots = expert_idx_tk.shape
  e = w_gate.shape[0]
  flat_e = expert_idx_tk.reshape(-1).astype(jnp.int32)
  sel = jnp.minimum(flat_e, e - 1)
  xa = jnp.repeat(x_td, kslots, axis=0)  # [t*k, d], assignment a = token * k + slot
  g = einsum("ad,adf->af", xa, w_gate[sel], dtype)
  u = einsum("ad,adf->af", xa, w_up[sel], dtype)
  y = einsum("af,afd->ad", jax.nn.silu(g) * u, w_down[sel], dtype)
  return jnp.where((flat_e < e)[:, None], y, jnp.zeros_like(y))


def dropless_experts(x_td: jax.Array, expert_idx_tk: jax.Array, weights_tk: jax.Array,
                     w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, dtype,
                     impl: str = "auto", block: int | None = None) -> jax.Array:
  """Routed SwiGLU experts without token dropping (one device).

  Args:
    x_td: [t, d] tokens.
    expert_idx_tk: [t, k] int expert ids in [0, e]; id e means "no expert"
      (a zero contribution, no compute), used for expert parallelism's empty
      receive slots.
    weights_tk: [t, k] combine weights.
    w_gate, w_up: [e, d, f]; w_down: [e, f, d].
    dtype: compute dtype (accumulation is f32).
    impl: 'auto', 'grouped', 'gather', 'ragged_dot' or 'blocked' (see module
      docstring and `resolve_impl`).
    block: rows per block for 'blocked' (default: `default_block`), rows per
      overflow tile for 'grouped' (default: model.moe_grouped.DEFAULT_TILE).

  Returns:
    [t, d] in `dtype`: sum_j weights_tj * expert_{idx_tj}(x_t).
  """
  _check_expert_args(x_td, expert_idx_tk, weights_tk, w_gate, w_up, w_down)
  t, kslots = expert_idx_tk.shape
  e = w_gate.shape[0]
  impl = resolve_impl(impl, t * kslots, e)
  if block is not None and int(block) < 1:
    raise ValueError(f"dropless_experts: block={block} must be >= 1.")
  if t == 0:  # an empty batch: every path below reads row 0 of something or reshapes by -1
    return jnp.zeros((0, x_td.shape[1]), dtype)
  if impl == "gather":
    y = _gather_swiglu(x_td, expert_idx_tk, w_gate, w_up, w_down, dtype)
    return einsum("tjd,tj->td", y.reshape(t, kslots, -1), weights_tk, dtype)
  flat_e, order, group_sizes = _sort_assignments(expert_idx_tk, e)
  if impl == "grouped":
    y = grouped_swiglu(x_td, order, group_sizes, kslots, w_gate, w_up, w_down, dtype, tile=block)
  elif impl == "ragged_dot":
    y = _grouped_swiglu(x_td, order, kslots, _ragged_dot(group_sizes, dtype), w_gate, w_up, w_down)
  else:
    block = default_block(t * kslots, e) if block is None else int(block)
    y = _blocked_swiglu(x_td, order, flat_e[order], group_sizes, kslots, w_gate, w_up, w_down,
                        dtype, block)
  return einsum("tjd,tj->td", y.reshape(t, kslots, -1), weights_tk, dtype)


def dense_experts_reference(x_td: jax.Array, expert_idx_tk: jax.Array, weights_tk: jax.Array,
                            w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                            dtype) -> jax.Array:
  """Reference: every expert on every token, combined with a masked weight matrix.

  Same signature and result as `dropless_experts`; costs e / k times the FLOPs.
  Rows of experts a token did not select are computed and multiplied by 0.
  """
  _check_expert_args(x_td, expert_idx_tk, weights_tk, w_gate, w_up, w_down)
  e = w_gate.shape[0]
  onehot = expert_idx_tk[..., None] == jnp.arange(e)  # [t, k, e]
  c_te = jnp.sum(jnp.where(onehot, weights_tk[..., None].astype(jnp.float32), 0.0), axis=1)
  g = einsum("td,edf->tef", x_td, w_gate, dtype)
  u = einsum("td,edf->tef", x_td, w_up, dtype)
  # The combine weight scales each expert's hidden units, so the down
  # projection and the sum over experts are one [t, e*f] x [e*f, d] matmul
  # (this also keeps XLA:CPU off batched bf16 dots, which it rejects).
  h = (jax.nn.silu(g) * u).astype(jnp.float32) * c_te[..., None]
  return einsum("tef,efd->td", h, w_down, dtype)


def mxfp4_dropless_experts(x_td: jax.Array, expert_idx_tk: jax.Array, weights_tk: jax.Array,
                           gate: Any, up: Any, down: Any, dtype) -> jax.Array:
  """`dropless_experts` with MXFP4 expert weights read by the fused grouped-matmul kernel.

  gate/up/down are `model.quant.MXFP4Weight`s or their {'blocks', 'scales'}
  values (w_gate [e, d, f] stored as blocks [e, f, d/32, 16], w_down [e, f, d]
  as [e, d, f/32, 16]); the kernel unpacks and scales them tile by tile, so no
  dense copy of an expert exists. Ids equal to e ("no expert") give zeros.
  """
  from pallas_kernels.mxfp4.ops import mxfp4_ragged_matmul  # noqa: PLC0415

  t, kslots = expert_idx_tk.shape
  gate, up, down = (w if isinstance(w, dict) else w.get_value() for w in (gate, up, down))
  _, order, group_sizes = _sort_assignments(expert_idx_tk, gate["blocks"].shape[0])

  def mm(a, w):
    return mxfp4_ragged_matmul(a.astype(dtype), w["blocks"], w["scales"], group_sizes).astype(dtype)

  y = _grouped_swiglu(x_td, order, kslots, mm, gate, up, down)
  return einsum("tjd,tj->td", y.reshape(t, kslots, -1), weights_tk, dtype)
