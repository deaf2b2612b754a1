"""Loss, optimizer and the jitted train step.

One code path for 1 CPU device and for a TPU/GPU mesh: the step is traced
under `sharding.mesh.activate(mesh)`, parameters and optimizer state carry
their rule shardings (`sharding.state`), the batch arrives sharded over the
batch mesh axes, and XLA's SPMD partitioner inserts the FSDP all-gathers /
reduce-scatters and tensor-parallel collectives; the MoE layers run their own
expert-parallel exchange (`sharding.expert_parallel`).

Batch layout (what the data pipeline produces, packed or not):
  inputs      int32 [b, t]  tokens fed to the model
  targets     int32 [b, t]  next tokens
  positions   int32 [b, t]  position within each packed segment
  segment_ids int32 [b, t]  packed-document ids; 0 marks padding
  loss_mask   f32   [b, t]  optional; default: segment_ids > 0

Loss = mean token cross-entropy over the mask
     + z_loss_weight * router z-loss + seq_aux_weight * sequence balance loss
     + indexer_loss_weight * DSA indexer KL (its gradient reaches only the
       indexer: the model detaches the indexer's inputs).
After the optimizer update, each MoE layer's selection bias moves by
`router_bias_rate` against its measured load (aux-loss-free balancing).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from model.moe import find_moe_modules, update_router_biases

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The `config.train` section (see configs/horizon.py for meanings)."""
  steps: int
  global_batch: int
  seq_len: int
  learning_rate: float
  warmup_steps: int
  end_lr_fraction: float
  weight_decay: float
  b1: float
  b2: float
  eps: float
  grad_clip: float
  z_loss_weight: float
  seq_aux_weight: float
  indexer_loss_weight: float
  router_bias_rate: float

  @classmethod
  def from_config(cls, train_cfg: Any) -> "TrainConfig":
    d = dict(train_cfg.items()) if hasattr(train_cfg, "items") else dict(train_cfg)
    names = {f.name for f in dataclasses.fields(cls)}
    if set(d) != names:
      raise ValueError(f"config.train: unknown fields {sorted(set(d) - names)}, missing fields "
                       f"{sorted(names - set(d))}.")
    for f in ("steps", "global_batch", "seq_len"):
      if not isinstance(d[f], int) or d[f] < 1:
        raise ValueError(f"config.train.{f}={d[f]!r}: must be a positive int.")
    if d["learning_rate"] <= 0:
      raise ValueError(f"config.train.learning_rate={d['learning_rate']!r}: must be > 0.")
    return cls(**d)


def learning_rate_schedule(tc: TrainConfig) -> optax.Schedule:
  """Linear warm-up to learning_rate, then cosine decay to end_lr_fraction of it."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=tc.learning_rate, warmup_steps=max(tc.warmup_steps, 1),
      decay_steps=max(tc.steps, tc.warmup_steps + 1),
      end_value=tc.learning_rate * tc.end_lr_fraction)


def decay_mask(params: Any) -> Any:
  """Weight decay on matrices only: not on norm scales, biases, A_log or dt_bias (all 1-D)."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW with the warm-up + cosine schedule."""
  return optax.chain(
      optax.clip_by_global_norm(tc.grad_clip),
      optax.adamw(learning_rate_schedule(tc), b1=tc.b1, b2=tc.b2, eps=tc.eps,
                  weight_decay=tc.weight_decay, mask=decay_mask))


def token_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array
                        ) -> tuple[jax.Array, jax.Array]:
  """(sum of masked token CE, number of masked tokens); logits f32 [b, t, v]."""
  logz = jax.nn.logsumexp(logits, axis=-1)
  gold = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  mask = mask.astype(jnp.float32)
  return jnp.sum((logz - gold) * mask), jnp.sum(mask)


def loss_fn(model: nnx.Module, batch: Mapping[str, jax.Array], tc: TrainConfig
            ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Total loss and metrics for one batch (see module docstring)."""
  missing = [k for k in BATCH_KEYS if k not in batch]
  if missing:
    raise ValueError(f"batch is missing {missing}; a batch needs {BATCH_KEYS} (+ optional loss_mask).")
  logits, aux = model(batch["inputs"], batch["positions"], batch["segment_ids"], batch.get("images"))
  mask = batch.get("loss_mask", (batch["segment_ids"] > 0).astype(jnp.float32))
  ce_sum, n = token_cross_entropy(logits, batch["targets"], mask)
  ce = ce_sum / jnp.maximum(n, 1.0)
  loss = (ce + tc.z_loss_weight * aux["z_loss"] + tc.seq_aux_weight * aux["seq_aux_loss"]
          + tc.indexer_loss_weight * aux["indexer_loss"])
  metrics = {"loss": loss, "ce": ce, "tokens": n, "z_loss": aux["z_loss"],
             "seq_aux_loss": aux["seq_aux_loss"], "indexer_loss": aux["indexer_loss"]}
  if "load" in aux:
    metrics["load"] = aux["load"]
    metrics["dropped"] = jnp.sum(aux["dropped"])
  return loss, metrics


def train_step(model: nnx.Module, optimizer: nnx.Optimizer, batch: Mapping[str, jax.Array],
               tc: TrainConfig) -> dict[str, jax.Array]:
  """One optimizer step (call through `jit_train_step`). Updates model and optimizer in place."""
  (_, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch, tc)
  metrics["grad_norm"] = optax.global_norm(grads)
  optimizer.update(model, grads)
  if "load" in metrics:
    moe = list(find_moe_modules(model).values())
    update_router_biases(moe, list(metrics["load"]), tc.router_bias_rate)
  return metrics


jit_train_step = nnx.jit(train_step, static_argnames=("tc",), donate_argnums=(0, 1))
