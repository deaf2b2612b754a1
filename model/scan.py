"""Scan over the repeating layer pattern, so tracing and compiling cost one period, not the depth.

The stack repeats with a fixed period after the dense-FFN prefix: layer i is
DSA when `i % dsa_period == dsa_offset` and MoE from `num_dense_layers` on, so
layers `num_dense_layers + u*dsa_period + j` have the same kinds for every
unit u. `layer_plan` cuts the stack into unrolled layers and one scanned
segment of `repeats` units of `period` blocks; `run_blocks` runs it.

Parameters stay per layer (checkpoints, sharding rules, MXFP4 and serving are
unchanged). At trace time the scanned segment's per-unit states are stacked
(`jnp.stack`, one copy of those parameters per forward; its gradient is the
matching slices) and `jax.lax.scan` runs one unit per iteration. The maths is
the unrolled stack's; remat applies per block inside the unit, as unrolled.
(MaxText instead stores scanned parameters stacked; that layout would save the
copy but change every consumer of the parameter tree.)

Einsum legend: b batch, t tokens, d model dim, u scan units.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import ModelConfig

_POLICIES = {"save_dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims}


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """Layers [start, start + period*repeats) run as `repeats` scanned units of `period` blocks;
  every other layer is unrolled. repeats == 0: nothing is scanned."""
  start: int
  period: int
  repeats: int

  @property
  def stop(self) -> int:
    return self.start + self.period * self.repeats


def layer_plan(cfg: ModelConfig) -> LayerPlan:
  """Where the stack repeats (see the module docstring); repeats 0 without scan_layers or when
  fewer than two whole periods follow the dense prefix (a scan of one unit saves nothing)."""
  start, period = cfg.num_dense_layers, cfg.dsa_period
  repeats = (cfg.num_layers - start) // period
  if not cfg.scan_layers or repeats < 2:
    return LayerPlan(start, period, 0)
  kinds = list(zip(cfg.layer_kinds, cfg.ffn_kinds, strict=True))
  unit = kinds[start:start + period]
  for u in range(repeats):  # holds by construction of layer_kinds / ffn_kinds; checked anyway
    if kinds[start + u * period:start + (u + 1) * period] != unit:
      raise AssertionError(f"layer pattern does not repeat at unit {u}: {kinds}")
  return LayerPlan(start, period, repeats)


def _pure_block(graphdef: nnx.GraphDef, remat: str) -> Callable:
  """(state, x, positions, segment_ids, replay) -> (x, aux) for one block, rematerialised as the
  config says."""
  def f(state, x, positions, segment_ids, replay):
    return nnx.merge(graphdef, state)(x, positions, segment_ids, replay)
  if remat == "none":
    return f
  return jax.checkpoint(f, policy=_POLICIES.get(remat))


def run_blocks(blocks: Sequence[Any], cfg: ModelConfig, x: jax.Array, positions: jax.Array,
               segment_ids: jax.Array, replays: Sequence[Any], unrolled: Callable,
               constrain_x: Callable) -> tuple[jax.Array, list[dict[str, Any]]]:
  """The stack on x [b, t, d]: (x, per-layer aux dicts in layer order).

  replays: per layer, None or the MoE routing replay (ids [b, t, k], mask [b, t]).
  unrolled(block, x, positions, segment_ids, replay): how an unrolled layer runs (with remat).
  constrain_x: the residual stream's sharding constraint, applied after every layer.
  """
  plan = layer_plan(cfg)
  auxes: list[dict[str, Any]] = [{} for _ in blocks]
  for i in range(plan.start):
    x, auxes[i] = unrolled(blocks[i], x, positions, segment_ids, replays[i])
    x = constrain_x(x)
  if plan.repeats:
    x, scanned = _scan_segment(blocks, plan, cfg.remat, x, positions, segment_ids, replays, constrain_x)
    auxes[plan.start:plan.stop] = scanned
  for i in range(plan.stop if plan.repeats else plan.start, len(blocks)):
    x, auxes[i] = unrolled(blocks[i], x, positions, segment_ids, replays[i])
    x = constrain_x(x)
  return x, auxes


def _scan_segment(blocks, plan: LayerPlan, remat: str, x, positions, segment_ids, replays, constrain_x):
  p, n = plan.period, plan.repeats
  layer = lambda u, j: plan.start + u * p + j  # noqa: E731
  graphdefs, stacked, ids, masks = [], [], [], []
  for j in range(p):
    splits = [nnx.split(blocks[layer(u, j)]) for u in range(n)]
    graphdef = splits[0][0]
    for u, (g, _) in enumerate(splits):
      if g != graphdef:
        raise ValueError(f"scan_layers: layer {layer(u, j)} differs in structure from layer "
                         f"{layer(0, j)} (e.g. a partly quantised stack); set "
                         "config.model.scan_layers=False.")
    graphdefs.append(graphdef)
    stacked.append(jax.tree.map(lambda *a: jnp.stack(a), *[s for _, s in splits]))
    unit_replays = [replays[layer(u, j)] for u in range(n)]
    if unit_replays[0] is None:
      ids.append(None)
      masks.append(None)
    else:  # ids differ per layer (stacked as xs); the mask is the same for every layer
      ids.append(jnp.stack([r[0] for r in unit_replays]))
      masks.append(unit_replays[0][1])
  fns = [_pure_block(g, remat) for g in graphdefs]

  def unit(x, xs):
    states, unit_ids = xs
    out = []
    for j in range(p):
      replay = None if unit_ids[j] is None else (unit_ids[j], masks[j])
      x, aux = fns[j](states[j], x, positions, segment_ids, replay)
      x = constrain_x(x)
      out.append(aux)
    return x, out

  x, aux_stacked = jax.lax.scan(unit, x, (stacked, ids))
  per_layer = [jax.tree.map(lambda a, u=u: a[u], aux_stacked[j]) for u in range(n) for j in range(p)]
  return x, per_layer
