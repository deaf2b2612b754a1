"""Mixture-of-Experts feed-forward: router, bias balancing, dropless experts.

Routing follows DeepSeekMoE (Dai et al., 2024, arXiv:2401.06066: fine-grained
routed experts plus always-on shared experts) and DeepSeek-V3 (arXiv:2412.19437,
sec. 2.1.2):

* Scores are sigmoid (or softmax) of the router logits, computed in f32 because
  small logit differences decide the top-k and bf16 would flip them.
* Auxiliary-loss-free balancing: a per-expert bias is added to the scores for
  *selection only*. It is not a gradient-trained parameter (`RouterBias` is an
  `nnx.Variable`, not an `nnx.Param`, so optimizers never see it); after each
  step it moves by `rate * sign(mean load - load)`, steering tokens away from
  overloaded experts without a loss term that fights the LM objective. The
  combine weights use the unbiased scores, so the bias never scales outputs.
* Group-limited routing: experts are split into groups, a group is scored by
  the sum of its two best (biased) scores, and each token may only pick experts
  from its best `router_topk_groups` groups, bounding how many devices a token
  is sent to under expert parallelism.
* The complementary sequence-wise balance loss of DeepSeek-V3 (eq. 17-20) keeps
  any single sequence from collapsing onto a few experts; the router z-loss of
  ST-MoE (Zoph et al., 2022, arXiv:2202.08906) keeps logits small so the
  router stays numerically stable. Both are returned raw; their weights live in
  the training config.

Experts are SwiGLU, computed *dropless*: every token-assignment is computed,
no capacity factor drops tokens. Assignments are sorted by expert (stable), so
each expert owns a contiguous run of rows, and the runs are multiplied by their
expert's weights as a grouped matmul. Two grouped-matmul implementations compute
the same function:

* 'ragged_dot': `jax.lax.ragged_dot` with the per-expert group sizes. On TPU
  and GPU it lowers to XLA's native ragged dot. On XLA:CPU (jax 0.10) JAX lowers
  it to a *masked dense* dot over all groups ([e, rows, d] operand), which costs
  `num_experts` times the grouped FLOPs -- more than running every expert on
  every token.
* 'blocked': each expert's run is padded to a multiple of `block` rows, so every
  block of rows belongs to one expert; a batched matmul then multiplies each
  block by its expert's gathered weights. Cost is at most
  `rows + num_experts * (block - 1)` rows of work, with static shapes; this is
  the fast path on CPU. It gathers one copy of an expert's weights per block,
  cheap at CPU sizes but not at the full design's, where 'ragged_dot' runs.

`impl='auto'` picks 'ragged_dot' on TPU/GPU and 'blocked' elsewhere.
`dense_experts_reference` runs every expert on every token and masks: the plain
reference both are tested against.

Einsum legend: b batch, t token, d model dim, e expert, f expert FFN width,
j routed slot (one of the top-k), n row block, m row within a block.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import ModelConfig
from model.layers import MLP, einsum, param
from sharding import expert_parallel

IMPLS = ("auto", "ragged_dot", "blocked")


class RouterBias(nnx.Variable):
  """Per-expert selection bias for aux-loss-free balancing (not an nnx.Param)."""


# ---- routing ---------------------------------------------------------------


def router_scores(logits: jax.Array, kind: str) -> jax.Array:
  """Affinity scores from router logits, in f32.

  Args:
    logits: [..., e] router logits.
    kind: 'sigmoid' (DeepSeek-V3) or 'softmax' (DeepSeekMoE / V2).

  Returns:
    [..., e] f32 scores.
  """
  logits = logits.astype(jnp.float32)
  if kind == "sigmoid":
    return jax.nn.sigmoid(logits)
  if kind == "softmax":
    return jax.nn.softmax(logits, axis=-1)
  raise ValueError(f"router_scores: kind={kind!r}; choose 'sigmoid' or 'softmax'.")


def _check_routing_args(num_experts: int, k: int, groups: int, topk_groups: int) -> None:
  if groups < 1 or num_experts % groups:
    raise ValueError(f"groups={groups} must divide num_experts={num_experts} "
                     "(use groups=1 to disable group-limited routing).")
  if not 1 <= topk_groups <= groups:
    raise ValueError(f"topk_groups={topk_groups} must be in [1, groups={groups}].")
  if not 1 <= k <= topk_groups * (num_experts // groups):
    raise ValueError(f"k={k} must be in [1, {topk_groups * (num_experts // groups)}] (the experts "
                     f"in the top {topk_groups} groups); lower k or raise topk_groups.")


def select_experts(scores: jax.Array, bias: jax.Array, k: int, groups: int = 1,
                   topk_groups: int = 1) -> jax.Array:
  """Top-k expert ids by biased score, optionally group-limited.

  Args:
    scores: [..., e] f32 router scores.
    bias: [e] selection bias (RouterBias value).
    k: experts per token.
    groups: number of expert groups (1 disables group-limited routing).
    topk_groups: groups each token may pick experts from.

  Returns:
    [..., k] int32 expert ids, best first. Not differentiable (ids).
  """
  e = scores.shape[-1]
  if bias.shape != (e,):
    raise ValueError(f"select_experts: bias shape {bias.shape} != (num_experts={e},).")
  _check_routing_args(e, k, groups, topk_groups)
  biased = jax.lax.stop_gradient(scores.astype(jnp.float32) + bias.astype(jnp.float32))
  if groups > 1:
    per_group = e // groups
    grouped = biased.reshape(biased.shape[:-1] + (groups, per_group))
    if per_group == 1:
      group_score = grouped[..., 0]
    else:
      group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [..., groups]
    _, top_groups = jax.lax.top_k(group_score, topk_groups)  # [..., topk_groups]
    keep = jnp.any(top_groups[..., None] == jnp.arange(groups), axis=-2)  # [..., groups]
    keep = jnp.repeat(keep, per_group, axis=-1)  # [..., e]
    biased = jnp.where(keep, biased, -jnp.inf)
  _, idx = jax.lax.top_k(biased, k)
  return idx.astype(jnp.int32)


def combine_weights(scores: jax.Array, idx: jax.Array, norm_topk_prob: bool,
                    routed_scaling: float) -> jax.Array:
  """Combine weights of the selected experts from the UNBIASED scores.

  Args:
    scores: [..., e] f32 scores (no bias).
    idx: [..., k] selected expert ids.
    norm_topk_prob: normalise the k weights to sum to 1.
    routed_scaling: multiplier applied after normalisation (DeepSeek-V3).

  Returns:
    [..., k] f32 weights.
  """
  w = jnp.take_along_axis(scores.astype(jnp.float32), idx, axis=-1)
  if norm_topk_prob:
    w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
  return w * routed_scaling


def sequence_aux_loss(scores: jax.Array, idx: jax.Array) -> jax.Array:
  """DeepSeek-V3 complementary sequence-wise balance loss (unweighted).

  Per sequence: f_i = e / (k t) * #tokens choosing i, P_i = mean over tokens of
  scores_i / sum(scores); loss = sum_i f_i P_i, averaged over the batch. A
  perfectly balanced sequence gives 1.

  Args:
    scores: [b, t, e] f32 unbiased scores.
    idx: [b, t, k] selected expert ids.

  Returns:
    f32 scalar.
  """
  b, t, e = scores.shape
  k = idx.shape[-1]
  counts = jax.vmap(lambda i: jnp.bincount(i.reshape(-1), length=e))(idx)  # [b, e]
  f = counts.astype(jnp.float32) * (e / (k * t))
  s = scores.astype(jnp.float32)
  p = jnp.mean(s / jnp.sum(s, axis=-1, keepdims=True), axis=1)  # [b, e]
  return jnp.mean(jnp.sum(f * p, axis=-1))


def router_z_loss(logits: jax.Array) -> jax.Array:
  """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2.

  Args:
    logits: [..., e] router logits.

  Returns:
    f32 scalar.
  """
  return jnp.mean(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))


# ---- experts ---------------------------------------------------------------


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


def _resolve_impl(impl: str) -> str:
  if impl not in IMPLS:
    raise ValueError(f"dropless_experts: impl={impl!r}; choose one of {IMPLS}.")
  if impl == "auto":
    return "ragged_dot" if jax.default_backend() in ("tpu", "gpu") else "blocked"
  return impl


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
    impl: 'auto', 'ragged_dot' or 'blocked' (see module docstring).
    block: rows per block for 'blocked' (default: `default_block`).

  Returns:
    [t, d] in `dtype`: sum_j weights_tj * expert_{idx_tj}(x_t).
  """
  _check_expert_args(x_td, expert_idx_tk, weights_tk, w_gate, w_up, w_down)
  impl = _resolve_impl(impl)
  t, kslots = expert_idx_tk.shape
  e = w_gate.shape[0]
  flat_e, order, group_sizes = _sort_assignments(expert_idx_tk, e)
  if impl == "ragged_dot":
    y = _grouped_swiglu(x_td, order, kslots, _ragged_dot(group_sizes, dtype), w_gate, w_up, w_down)
  else:
    block = default_block(t * kslots, e) if block is None else int(block)
    if block < 1:
      raise ValueError(f"dropless_experts: block={block} must be >= 1.")
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


# ---- module ----------------------------------------------------------------


class MoE(nnx.Module):
  """Routed SwiGLU experts + shared experts with sigmoid/softmax routing.

  Attributes:
    w_router: [d, e] router weights.
    router_bias: RouterBias [e] f32, selection only; updated by `update_bias`.
    w_gate, w_up: [e, d, f]; w_down: [e, f, d] routed experts.
    shared: MLP of width num_shared_experts * expert_dim, or None.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, impl: str = "auto"):
    if impl not in IMPLS:
      raise ValueError(f"MoE: impl={impl!r}; choose one of {IMPLS}.")
    self.cfg = cfg
    self.impl = impl
    d, e, f = cfg.d_model, cfg.num_experts, cfg.expert_dim
    pd = cfg.jnp_param_dtype
    self.w_router = param(rngs, (d, e), ("embed", "expert"), pd)
    self.router_bias = RouterBias(jnp.zeros((e,), jnp.float32), axes=("expert",))
    self.w_gate = param(rngs, (e, d, f), ("expert", "embed", "mlp"), pd, fan_in=d)
    self.w_up = param(rngs, (e, d, f), ("expert", "embed", "mlp"), pd, fan_in=d)
    self.w_down = param(rngs, (e, f, d), ("expert", "mlp", "embed"), pd, fan_in=f)
    self.shared = (MLP(d, cfg.num_shared_experts * f, rngs=rngs, param_dtype=pd, dtype=cfg.jnp_dtype)
                   if cfg.num_shared_experts > 0 else None)

  def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Router forward.

    Args:
      x: [b, t, d].

    Returns:
      (logits [b, t, e] f32, scores [b, t, e] f32, idx [b, t, k] int32,
       weights [b, t, k] f32).
    """
    cfg = self.cfg
    logits = einsum("btd,de->bte", x, self.w_router[...], jnp.float32)
    scores = router_scores(logits, cfg.router_score)
    idx = select_experts(scores, self.router_bias[...], cfg.experts_per_token, cfg.router_groups,
                         cfg.router_topk_groups)
    weights = combine_weights(scores, idx, cfg.norm_topk_prob, cfg.routed_scaling)
    return logits, scores, idx, weights

  def __call__(self, x: jax.Array) -> tuple[jax.Array, dict]:
    """MoE feed-forward.

    Args:
      x: [b, t, d] activations.

    Returns:
      y [b, t, d] in cfg.dtype; aux = {'load': f32 [e] token-assignments per
      expert, 'z_loss': f32 scalar, 'seq_aux_loss': f32 scalar, 'dropped': f32
      scalar, assignments dropped by a capacity-limited expert-parallel exchange}.
    """
    cfg = self.cfg
    if x.ndim != 3 or x.shape[-1] != cfg.d_model:
      raise ValueError(f"MoE: x must be [batch, seq, d_model={cfg.d_model}]; got shape {x.shape}.")
    b, t, d = x.shape
    k = cfg.experts_per_token
    logits, scores, idx, weights = self.route(x)
    y, dropped = self._experts(x.reshape(b * t, d), idx.reshape(b * t, k), weights.reshape(b * t, k))
    y = y.reshape(b, t, d)
    if self.shared is not None:
      y = y + self.shared(x)
    aux = {
        "load": jnp.bincount(idx.reshape(-1), length=cfg.num_experts).astype(jnp.float32),
        "z_loss": router_z_loss(logits),
        "seq_aux_loss": sequence_aux_loss(scores, idx),
        "dropped": dropped,
    }
    return y, aux

  def _experts(self, x_td, idx_tk, weights_tk) -> tuple[jax.Array, jax.Array]:
    """Routed experts: one device, or expert-parallel when a mesh is active.

    Returns (y [t, d], dropped): the f32 count of token-assignments the
    capacity exchange dropped (always 0 without a mesh or with 'ragged').
    """
    cfg = self.cfg
    if cfg.quantization != "none" and cfg.use_pallas:
      # MXFP4 experts read packed by the fused grouped-matmul kernel (one device or EP shards).
      experts = (self.w_gate.get_value(), self.w_up.get_value(), self.w_down.get_value())
      grouped = mxfp4_dropless_experts
    else:
      # Dense weights, or MXFP4 ones dequantized on read (model.quant.MXFP4Weight).
      experts = (self.w_gate[...], self.w_up[...], self.w_down[...])
      grouped = functools.partial(dropless_experts, impl=self.impl)
    if jax.sharding.get_abstract_mesh().empty:
      return grouped(x_td, idx_tk, weights_tk, *experts, cfg.jnp_dtype), jnp.zeros((), jnp.float32)

    def local(x, ids, w, w_gate, w_up, w_down):
      return grouped(x, ids, w, w_gate, w_up, w_down, cfg.jnp_dtype)

    return expert_parallel.expert_parallel_experts(
        x_td, idx_tk, weights_tk, *experts, local_experts=local, exchange=cfg.expert_exchange,
        capacity_factor=cfg.capacity_factor)

  def update_bias(self, load: jax.Array, rate: float) -> None:
    """Aux-loss-free balancing step: bias += rate * sign(mean(load) - load).

    Call after the optimizer step with the layer's `aux['load']` (summed over
    micro-batches if any). Overloaded experts get a lower bias. No gradient
    flows: the load is an integer count and the bias is not an nnx.Param.

    Args:
      load: [e] token-assignment counts.
      rate: bias update speed (DeepSeek-V3 uses 1e-3).
    """
    load = jax.lax.stop_gradient(jnp.asarray(load, jnp.float32))
    e = self.cfg.num_experts
    if load.shape != (e,):
      raise ValueError(f"MoE.update_bias: load shape {load.shape} != (num_experts={e},); pass "
                       "aux['load'] of this layer.")
    self.router_bias[...] = self.router_bias[...] + rate * jnp.sign(jnp.mean(load) - load)


def update_router_biases(moe_modules: Sequence[MoE], loads: Sequence[jax.Array], rate: float) -> None:
  """Applies `MoE.update_bias` to each layer with its own load.

  Args:
    moe_modules: the MoE layers, in the same order as `loads`.
    loads: per-layer [e] loads (e.g. the decoder's aux loads, in layer order).
    rate: bias update speed.
  """
  moe_modules, loads = list(moe_modules), list(loads)
  if len(moe_modules) != len(loads):
    raise ValueError(f"update_router_biases: {len(moe_modules)} MoE modules but {len(loads)} loads; "
                     "pass one load per MoE layer, in layer order.")
  for layer, load in zip(moe_modules, loads, strict=True):
    layer.update_bias(load, rate)


def find_moe_modules(model: nnx.Module) -> dict[tuple, MoE]:
  """All MoE submodules of `model`, keyed by their graph path, in graph order.

  Lets a train step pair each layer with its load without knowing the model's
  layout: `update_router_biases(list(found.values()), loads_in_same_order, rate)`.
  """
  return {tuple(path): node for path, node in nnx.iter_graph(model) if isinstance(node, MoE)}
