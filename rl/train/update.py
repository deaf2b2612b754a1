"""The trainer's device programs: score a batch (log-probs, entropy) and one policy update.

The update reuses training/: the optimizer (`make_train_state`: AdamW, clipping, skip of
non-finite updates), the MoE auxiliary losses with config.train's weights, and the router-bias
update; only the data term differs (objectives.policy_loss instead of cross-entropy).
Micro-batches are rows of the batch; with `token_weights` of the whole batch their gradients
add up to the whole batch's gradient exactly.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from model.moe import find_moe_modules, update_router_biases
from rl.train import objectives as obj_lib
from training import leaf_groups
from training.train_step import (
  TrainConfig,
  applied_updates,
  apply_update,
  learning_rate_schedule,
  unless_finite,
)


def token_logp(model: nnx.Module, batch: Mapping[str, jax.Array], replay: bool = False
               ) -> tuple[jax.Array, jax.Array, dict]:
  """(log-prob of each target [B, T], entropy of each position's distribution [B, T], model aux).

  replay: route MoE tokens to the experts the engine recorded (batch routing / routing_mask).
  """
  routing = (batch["routing"], batch["routing_mask"]) if replay else (None, None)
  logits, aux = model(batch["inputs"], batch["positions"], batch["segment_ids"], routing=routing[0],
                      routing_mask=routing[1])
  logits = logits.astype(jnp.float32)
  logz = jax.nn.logsumexp(logits, axis=-1)
  gold = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
  probs = jnp.exp(logits - logz[..., None])
  entropy = logz - jnp.sum(probs * logits, axis=-1)
  return gold - logz, entropy, aux


def routing_mismatch(routed: jax.Array, batch: Mapping[str, jax.Array]) -> jax.Array:
  """Fraction of (recorded token, MoE layer) pairs whose expert set differs between the trainer's
  routing (aux['routed'] [layers, B, T, k]) and the engine's (batch['routing'] [B, T, layers, k])."""
  mine = jnp.sort(jnp.moveaxis(routed, 0, 2), axis=-1)
  theirs = jnp.sort(batch["routing"], axis=-1)
  differs = jnp.any(mine != theirs, axis=-1)  # [B, T, layers]
  known = (batch["routing_mask"] > 0)[..., None] & (batch["segment_ids"] > 0)[..., None]
  return jnp.sum(differs & known) / jnp.maximum(jnp.sum(jnp.broadcast_to(known, differs.shape)), 1)


@nnx.jit(static_argnames=("replay",))
def score(model: nnx.Module, batch: Mapping[str, jax.Array], replay: bool = False
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """log-probs, entropies (no gradient) and the routing mismatch (-1 without recorded routing)."""
  logp, entropy, aux = token_logp(model, batch, replay)
  mismatch = (routing_mismatch(aux["routed"], batch) if "routing" in batch and "routed" in aux
              else jnp.asarray(-1.0))
  return logp, entropy, mismatch


def _loss(model, batch, obj: obj_lib.Objective, tc: TrainConfig, n_micro: int, replay: bool):
  logp, _, aux = token_logp(model, batch, replay)
  loss, metrics = obj_lib.policy_loss(logp, batch, obj)
  aux_loss = (tc.z_loss_weight * aux["z_loss"] + tc.seq_aux_weight * aux["seq_aux_loss"]
              + tc.indexer_loss_weight * aux["indexer_loss"])
  metrics = {**metrics, "policy_loss": loss, "z_loss": aux["z_loss"], "indexer_loss": aux["indexer_loss"]}
  if "load" in aux:
    metrics["load"] = aux["load"]
  return loss + aux_loss / n_micro, metrics


@nnx.jit(static_argnames=("obj", "tc", "n_micro", "replay"))
def micro_grads(model: nnx.Module, optimizer: nnx.Optimizer, batch: Mapping[str, jax.Array],
                obj: obj_lib.Objective, tc: TrainConfig, n_micro: int, replay: bool = False):
  """(gradients w.r.t. the optimizer's trainable params, metrics) of one micro-batch."""
  grad_fn = nnx.value_and_grad(_loss, argnums=nnx.DiffState(0, optimizer.wrt), has_aux=True)
  (loss, metrics), grads = grad_fn(model, batch, obj, tc, n_micro, replay)
  return grads, {**metrics, "loss": loss}


@nnx.jit(static_argnames=("tc",), donate_argnums=(2,))
def apply_grads(model: nnx.Module, optimizer: nnx.Optimizer, grads, load, tc: TrainConfig,
                loss_finite: jax.Array | bool = True) -> dict:
  """One optimizer update (skipped, weights untouched, when the gradients or the loss are not
  finite: a non-finite loss with finite gradients was applied while the step said it was not)."""
  leaf_finite, grad_norm = leaf_groups.finite_and_norm(grads, tc.group_max_elements)
  finite = jnp.all(leaf_finite) & jnp.asarray(loss_finite)
  # The rate this update applies: the schedule counts applied updates only (apply_if_finite skips
  # the count of a skipped one), so optimizer.step, which counts every call, ran ahead of it.
  metrics = {"grad_norm": grad_norm, "finite": finite,
             "learning_rate": learning_rate_schedule(tc)(applied_updates(optimizer))}
  apply_update(model, optimizer, unless_finite(finite, grads))
  if load is not None:
    moe = list(find_moe_modules(model).values())
    update_router_biases(moe, list(load), jnp.where(finite, tc.router_bias_rate, 0.0))
  return metrics
