"""Mixture-of-Experts feed-forward layer: router, bias balancing, dropless experts.

The MoE layer of DeepSeekMoE (Dai et al., 2024, arXiv:2401.06066: fine-grained
routed experts plus always-on shared experts) and DeepSeek-V3 (arXiv:2412.19437,
sec. 2.1.2). Its parts live in two modules of pure functions:

* model/moe_routing.py: f32 router scores, group-limited top-k selection with
  a selection-only bias, combine weights, the sequence-wise balance loss and
  the router z-loss.
* model/moe_experts.py: the routed SwiGLU experts computed dropless as grouped
  matmuls ('grouped', 'gather', 'ragged_dot' or 'blocked'), their dense reference and the MXFP4
  variant.

This module holds the `MoE` nnx layer that wires them together (one device, or
expert-parallel under a mesh via sharding/expert_parallel.py) and the state of
the auxiliary-loss-free balancing (DeepSeek-V3): the per-expert `RouterBias`
is an `nnx.Variable`, not an `nnx.Param`, so optimizers never see it; after
each step `MoE.update_bias` moves it by `rate * sign(mean load - load)`,
steering tokens away from overloaded experts without a loss term that fights
the LM objective.

Einsum legend: b batch, t token, d model dim, e expert, f expert FFN width,
k routed slot (one of the top-k).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import ModelConfig
from model.layers import F32_SCOPE, MLP, einsum, param
from model.moe_experts import IMPLS, dropless_experts, mxfp4_dropless_experts
from model.moe_routing import (
    combine_weights,
    router_scores,
    router_z_loss,
    select_experts,
    sequence_aux_loss,
)
from sharding import expert_parallel


class RouterBias(nnx.Variable):
  """Per-expert selection bias for aux-loss-free balancing (not an nnx.Param)."""


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

  def route(self, x: jax.Array, replay: tuple[jax.Array, jax.Array] | None = None
            ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Router forward.

    Args:
      x: [b, t, d].
      replay: optional (ids int32 [b, t, k], use bool [b, t]): routing replay (R3). Where `use`
        is set the token goes to the given experts instead of its own top-k; the combine
        weights are still the current router's scores at those experts (differentiable).

    Returns:
      (logits [b, t, e] f32, scores [b, t, e] f32, idx [b, t, k] int32,
       weights [b, t, k] f32).
    """
    cfg = self.cfg
    with jax.named_scope(F32_SCOPE):  # routing decisions in f32 (the precision policy's exception)
      logits = einsum("btd,de->bte", x, self.w_router[...], jnp.float32)
    scores = router_scores(logits, cfg.router_score)
    idx = select_experts(scores, self.router_bias[...], cfg.experts_per_token, cfg.router_groups,
                         cfg.router_topk_groups)
    if replay is not None:
      ids, use = replay
      if ids.shape != idx.shape or use.shape != idx.shape[:-1]:
        raise ValueError(f"MoE routing replay: ids {ids.shape} / use {use.shape} must be {idx.shape} / "
                         f"{idx.shape[:-1]} (batch, tokens, experts_per_token).")
      idx = jnp.where(use[..., None], ids.astype(idx.dtype), idx)
    weights = combine_weights(scores, idx, cfg.norm_topk_prob, cfg.routed_scaling)
    return logits, scores, idx, weights

  def __call__(self, x: jax.Array, replay: tuple[jax.Array, jax.Array] | None = None,
               valid: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """MoE feed-forward.

    Args:
      x: [b, t, d] activations.
      replay: optional routing replay (see `route`).
      valid: optional bool [b, t], the real tokens (False on padding). Padding is still
        computed, but load, z_loss and seq_aux_loss count only real tokens: a batch padded
        to its longest row (an RL batch) must not steer the balancing bias.

    Returns:
      y [b, t, d] in cfg.dtype; aux = {'load': f32 [e] token-assignments per
      expert, 'z_loss': f32 scalar, 'seq_aux_loss': f32 scalar, 'dropped': f32
      scalar, assignments dropped by a capacity-limited expert-parallel exchange,
      'routed': int32 [b, t, k] the experts each token went to}.
    """
    cfg = self.cfg
    if x.ndim != 3 or x.shape[-1] != cfg.d_model:
      raise ValueError(f"MoE: x must be [batch, seq, d_model={cfg.d_model}]; got shape {x.shape}.")
    b, t, d = x.shape
    k = cfg.experts_per_token
    logits, scores, idx, weights = self.route(x, replay)
    y, dropped = self._experts(x.reshape(b * t, d), idx.reshape(b * t, k), weights.reshape(b * t, k))
    y = y.reshape(b, t, d)
    if self.shared is not None:
      y = y + self.shared(x)
    if valid is not None and valid.shape != (b, t):
      raise ValueError(f"MoE: valid must be [batch, seq] = {(b, t)}; got shape {valid.shape}.")
    per_assignment = None if valid is None else jnp.repeat(valid.reshape(-1).astype(jnp.float32), k)
    aux = {
        "load": jnp.bincount(idx.reshape(-1), per_assignment, length=cfg.num_experts).astype(jnp.float32),
        "z_loss": router_z_loss(logits, valid),
        "seq_aux_loss": sequence_aux_loss(scores, idx, valid),
        "dropped": dropped,
        "routed": idx,
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
    # set_value, not `[...] =`: flax 0.12's indexed set compares the new value's `.sharding`,
    # which on a tracer builds an error message by walking the whole trace so far (0.15 s per
    # layer at 93 layers: 28 of the train step's 44 s of tracing).
    self.router_bias.set_value(self.router_bias[...] + rate * jnp.sign(jnp.mean(load) - load))


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
