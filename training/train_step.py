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

What trains: every nnx.Param, except in the indexer warm-up stage
(`config.model.indexer_stage = 'dense_warmup'`), where only the lightning
indexer's parameters receive gradients and updates (DeepSeek-V3.2: the
indexer first learns to imitate dense attention with the model frozen).

Gradient accumulation (`grad_accum` micro-batches) scans over the batch split
along its rows. Every micro-batch's cross-entropy is normalised by the token
count of the *whole* batch, so the accumulated gradient is exactly the
gradient of the whole batch's loss.

Non-finite loss or gradients never reach the weights: the update is wrapped in
`leaf_groups.apply_if_finite` (optax.apply_if_finite's rule and state with a
fused check; state and weights unchanged, router biases frozen for that step;
`apply_update` runs it with the parameters' `p + u` inside, group by group)
and the step reports `finite` plus per-tensor finiteness, so the launcher stops
with the step and the first non-finite tensor's name (`nan_policy = 'stop'`) or
logs and continues (`'skip'`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from model.attention.dsa import GatedDSA
from model.config import ConfigError, is_int
from model.moe import find_moe_modules, update_router_biases
from training import leaf_groups
from training.knobs import check_nonnegative_numbers

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
  grad_accum: int
  nan_policy: str
  group_max_elements: int

  @classmethod
  def from_config(cls, train_cfg: Any) -> "TrainConfig":
    d = dict(train_cfg.items()) if hasattr(train_cfg, "items") else dict(train_cfg)
    names = {f.name for f in dataclasses.fields(cls)}
    if set(d) != names:
      raise ConfigError(f"config.train: unknown fields {sorted(set(d) - names)}, missing fields "
                        f"{sorted(names - set(d))}.")
    _plain_ints(d, ("steps", "global_batch", "seq_len", "grad_accum", "warmup_steps", "group_max_elements"))
    for f in ("steps", "global_batch", "seq_len"):
      if type(d[f]) is not int or d[f] < 1:
        raise ConfigError(f"config.train.{f}={d[f]!r}: must be a positive int.")
    if not isinstance(d["learning_rate"], (int, float)) or not 0 < d["learning_rate"] < math.inf:
      raise ConfigError(f"config.train.learning_rate={d['learning_rate']!r}: must be a finite number > 0.")
    # A negative router_bias_rate reverses load balancing; NaN in any of them poisons the step.
    check_nonnegative_numbers("train", d, ("z_loss_weight", "seq_aux_weight", "indexer_loss_weight",
                                           "router_bias_rate"))
    if type(d["grad_accum"]) is not int or d["grad_accum"] < 1:
      raise ConfigError(f"config.train.grad_accum={d['grad_accum']!r}: must be a positive int.")
    if d["global_batch"] % d["grad_accum"]:
      raise ConfigError(f"config.train.global_batch={d['global_batch']} is not divisible by "
                        f"config.train.grad_accum={d['grad_accum']}.")
    if type(d["group_max_elements"]) is not int or d["group_max_elements"] < 0:
      raise ConfigError(f"config.train.group_max_elements={d['group_max_elements']!r}: must be an int "
                        ">= 0 (0: no leaf groups).")
    _check_optimizer_numbers(d)
    warmup_ok = type(d["warmup_steps"]) is int and d["warmup_steps"] >= 0
    for f, ok, rule in (("warmup_steps", warmup_ok, "an int >= 0"),
                        ("b1", 0 <= d["b1"] < 1, "in [0, 1)"), ("b2", 0 <= d["b2"] < 1, "in [0, 1)"),
                        ("eps", d["eps"] > 0, "> 0"), ("weight_decay", d["weight_decay"] >= 0, ">= 0"),
                        ("end_lr_fraction", 0 <= d["end_lr_fraction"] <= 1, "in [0, 1]"),
                        ("grad_clip", d["grad_clip"] >= 0, ">= 0 (0: no clipping)")):
      if not ok:
        raise ConfigError(f"config.train.{f}={d[f]!r}: must be {rule}.")
    if d["nan_policy"] not in ("stop", "skip"):
      raise ConfigError(f"config.train.nan_policy={d['nan_policy']!r}: choose 'stop' or 'skip'.")
    return cls(**d)


def _plain_ints(d: dict[str, Any], fields: tuple[str, ...]) -> None:
  """numpy integers (a sweep script's) as Python ints, in place; a bool stays a bool and is refused
  (True counted as 1 step, 1 micro-batch)."""
  for f in fields:
    if is_int(d[f], numpy=True):
      d[f] = int(d[f])


def _check_optimizer_numbers(d: Mapping[str, Any]) -> None:
  """The optimizer's float knobs are numbers (a string failed with a bare TypeError), and eps and
  weight_decay finite: eps=inf made every update 0 (nothing trained, every step reported finite);
  weight_decay=inf turned the weights non-finite on the first update."""
  for f in ("b1", "b2", "eps", "weight_decay", "end_lr_fraction", "grad_clip"):
    if not isinstance(d[f], (int, float)) or isinstance(d[f], bool):
      raise ConfigError(f"config.train.{f}={d[f]!r}: must be a number.")
  for f in ("eps", "weight_decay"):
    if not math.isfinite(d[f]):
      raise ConfigError(f"config.train.{f}={d[f]!r}: must be finite.")


def learning_rate_schedule(tc: TrainConfig) -> optax.Schedule:
  """Linear warm-up to learning_rate, then cosine decay to end_lr_fraction of it.

  Update n (0-based) uses the rate at n + 1, so the first update is not a
  wasted step at rate 0 and warm-up reaches the peak on update warmup_steps-1.
  """
  base = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=tc.learning_rate, warmup_steps=max(tc.warmup_steps, 1),
      decay_steps=max(tc.steps, tc.warmup_steps + 1),
      end_value=tc.learning_rate * tc.end_lr_fraction)
  return lambda count: base(count + 1)


def decay_mask(params: Any) -> Any:
  """Weight decay on matrices only: not on norm scales, biases, A_log or dt_bias (all 1-D)."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation | leaf_groups.GroupedSkip:
  """Global-norm clipping, then AdamW with the warm-up + cosine schedule; skips non-finite updates.

  With tc.group_max_elements > 0 it runs on same-role leaves of all layers stacked together
  (training/leaf_groups.py, leaves up to that size), so it compiles once per parameter role, not
  once per layer; the state is kept per leaf either way (same checkpoints). It is then a
  `leaf_groups.GroupedSkip` (an optax transformation that keeps its parts for `apply_update`).
  """
  n = tc.group_max_elements
  mask = leaf_groups.grouped_mask(decay_mask) if n else decay_mask
  inner = optax.chain(
      # grad_clip 0 turns clipping off (a clip to norm 0 would zero every update); identity has
      # the same empty state, so the optimizer state's layout does not depend on it.
      optax.clip_by_global_norm(tc.grad_clip) if tc.grad_clip > 0 else optax.identity(),
      optax.adamw(learning_rate_schedule(tc), b1=tc.b1, b2=tc.b2, eps=tc.eps,
                  weight_decay=tc.weight_decay, mask=mask))
  # optax applies an update anyway after this many non-finite ones in a row: in effect never.
  never_apply = 1 << 30
  if n:
    return leaf_groups.grouped_apply_if_finite(inner, n, max_consecutive_errors=never_apply)
  return leaf_groups.apply_if_finite(inner, max_consecutive_errors=never_apply)


def apply_update(model: nnx.Module, optimizer: nnx.Optimizer, grads: Any) -> None:
  """`optimizer.update(model, grads)`; for leaf groups (`make_optimizer` with group_max_elements
  > 0, a `leaf_groups.GroupedSkip`) through `leaf_groups.grouped_apply`, ~1,400 fewer kernels to
  compile at 93 layers. Any other optimizer: exactly nnx's update.

  Same arithmetic and state; the same weights as nnx's update on the same gradients (test). The
  whole train step is a different XLA program, though, and not bitwise the old one: tiny at 11
  layers gave equal losses for two steps, 3e-7 apart at the third, and 0.2% apart by the sixth
  (Adam's first steps are close to sign steps, so last-bit differences grow fast).
  """
  if not isinstance(optimizer.tx, leaf_groups.GroupedSkip):
    optimizer.update(model, grads)
    return
  graph = optimizer.graph
  params = nnx.as_pure(nnx.state(model, optimizer.wrt, graph=graph))
  new_params, new_state = leaf_groups.grouped_apply(
      optimizer.tx, nnx.as_pure(nnx.state(grads, optimizer.wrt, graph=graph)),
      nnx.as_pure(optimizer.opt_state), params)
  nnx.update(model, new_params)
  nnx.update(optimizer.opt_state, nnx.state(new_state, graph=graph))
  optimizer.step[...] += 1


def _is_indexer_param(path, value) -> bool:
  return isinstance(value, nnx.Param) and any(str(p) in GatedDSA.INDEXER_PARAMS for p in path)


def trainable(model_cfg) -> Any:
  """The nnx filter of what trains: all Params, or only the indexer's in 'dense_warmup'."""
  return _is_indexer_param if model_cfg.indexer_stage == "dense_warmup" else nnx.Param


def make_train_state(model: nnx.Module, tc: TrainConfig) -> nnx.Optimizer:
  """The optimizer over `trainable(model.cfg)`; its state inherits the parameters' shardings."""
  return nnx.Optimizer(model, make_optimizer(tc), wrt=trainable(model.cfg))


def token_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array
                        ) -> tuple[jax.Array, jax.Array]:
  """(sum of masked token CE, number of masked tokens); logits f32 [b, t, v]."""
  logz = jax.nn.logsumexp(logits, axis=-1)
  gold = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  mask = mask.astype(jnp.float32)
  return jnp.sum((logz - gold) * mask), jnp.sum(mask)


def loss_fn(model: nnx.Module, batch: Mapping[str, jax.Array], tc: TrainConfig,
            total_tokens: jax.Array | None = None, micro_batches: int = 1
            ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Total loss and metrics for one batch (see module docstring).

  total_tokens / micro_batches: when the batch is one of several micro-batches,
  the CE sum is divided by the whole batch's token count and the auxiliary
  terms by the number of micro-batches, so the sum over micro-batches is the
  whole batch's loss.
  """
  missing = [k for k in BATCH_KEYS if k not in batch]
  if missing:
    raise ValueError(f"batch is missing {missing}; a batch needs {BATCH_KEYS} (+ optional loss_mask).")
  logits, aux = model(batch["inputs"], batch["positions"], batch["segment_ids"], batch.get("images"))
  mask = batch.get("loss_mask", (batch["segment_ids"] > 0).astype(jnp.float32))
  ce_sum, n = token_cross_entropy(logits, batch["targets"], mask)
  denom = jnp.maximum(n if total_tokens is None else total_tokens, 1.0)
  aux_loss = (tc.z_loss_weight * aux["z_loss"] + tc.seq_aux_weight * aux["seq_aux_loss"]
              + tc.indexer_loss_weight * aux["indexer_loss"])
  loss = ce_sum / denom + aux_loss / micro_batches
  metrics = {"ce_sum": ce_sum, "tokens": n, "z_loss": aux["z_loss"],
             "seq_aux_loss": aux["seq_aux_loss"], "indexer_loss": aux["indexer_loss"]}
  if "load" in aux:
    metrics["load"] = aux["load"]
    metrics["dropped"] = jnp.sum(aux["dropped"])
  return loss, metrics


def _split_micro(batch: Mapping[str, jax.Array], k: int) -> dict[str, jax.Array]:
  """[b, ...] -> [k, b/k, ...]: micro-batch i takes every k-th row, so each
  micro-batch keeps the batch's sharding over the batch mesh axes."""
  def split(x):
    b = x.shape[0]
    if b % k:
      raise ValueError(f"batch of {b} rows is not divisible by config.train.grad_accum={k}.")
    return jnp.swapaxes(x.reshape((b // k, k) + x.shape[1:]), 0, 1)
  return {name: split(x) for name, x in batch.items()}


def _grads(model: nnx.Module, batch, tc: TrainConfig, wrt) -> tuple[Any, dict]:
  """Gradients w.r.t. `wrt` and summed metrics, over tc.grad_accum micro-batches."""
  mask = batch.get("loss_mask", (batch["segment_ids"] > 0).astype(jnp.float32))
  total = jnp.sum(mask.astype(jnp.float32))
  grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt), has_aux=True)
  k = tc.grad_accum
  if k == 1:
    (loss, metrics), grads = grad_fn(model, batch, tc, total, 1)
    return grads, {**metrics, "loss": loss}
  graphdef, state = nnx.split(model)

  def body(carry, micro):
    # The model state rides in the carry (unchanged) so the Variables built by
    # merge hold values of the scan's own trace level, as nnx transforms require.
    st, g_sum, m_sum = carry
    (loss, metrics), g = grad_fn(nnx.merge(graphdef, st), micro, tc, total, k)
    metrics = {**metrics, "loss": loss}
    return (st, jax.tree.map(jnp.add, g_sum, g), jax.tree.map(jnp.add, m_sum, metrics)), None

  micro = _split_micro(batch, k)
  first = jax.tree.map(lambda x: x[0], micro)
  shapes = jax.eval_shape(lambda st, mb, n: grad_fn(nnx.merge(graphdef, st), mb, tc, n, k),
                          state, first, total)
  (_, m0), g0 = shapes
  zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t)  # noqa: E731
  init = (state, zeros(g0), zeros({**m0, "loss": shapes[0][0]}))
  (_, grads, metrics), _ = jax.lax.scan(body, init, micro)
  for name in ("z_loss", "seq_aux_loss", "indexer_loss"):
    metrics[name] = metrics[name] / k
  return grads, metrics


def train_step(model: nnx.Module, optimizer: nnx.Optimizer, batch: Mapping[str, jax.Array],
               tc: TrainConfig) -> dict[str, jax.Array]:
  """One optimizer step (call through `jit_train_step`). Updates model and optimizer in place.

  Returns metrics: loss, ce, tokens, z_loss, seq_aux_loss, indexer_loss,
  grad_norm, learning_rate, finite (bool), grad_finite / param_finite (bool
  per trainable leaf before the update, in `grad_names` order), and for MoE
  models load [n_moe, E], dropped.
  """
  grads, metrics = _grads(model, batch, tc, optimizer.wrt)
  metrics["ce"] = metrics.pop("ce_sum") / jnp.maximum(metrics["tokens"], 1.0)
  # Per-leaf checks, group by group (training/leaf_groups.py; group_max_elements 0: per leaf).
  metrics["grad_finite"], metrics["grad_norm"] = leaf_groups.finite_and_norm(grads, tc.group_max_elements)
  metrics["param_finite"] = leaf_groups.all_finite_per_leaf(nnx.state(model, optimizer.wrt),
                                                            tc.group_max_elements)
  metrics["finite"] = jnp.isfinite(metrics["loss"]) & jnp.all(metrics["grad_finite"])
  metrics["learning_rate"] = learning_rate_schedule(tc)(applied_updates(optimizer))
  # apply_if_finite: a no-op on non-finite gradients, and on a non-finite loss (unless_finite).
  apply_update(model, optimizer, unless_finite(metrics["finite"], grads))
  if "load" in metrics:
    moe = list(find_moe_modules(model).values())
    rate = jnp.where(metrics["finite"], tc.router_bias_rate, 0.0)
    update_router_biases(moe, list(metrics["load"]), rate)
  return metrics


def unless_finite(finite: jax.Array, grads: Any) -> Any:
  """`grads`, with NaN added to its first leaf unless `finite`. apply_if_finite looks at the
  gradients only: a non-finite loss with finite gradients (an inf auxiliary term without a
  gradient) was applied while the step reported finite=False and "the update was not applied"."""
  leaves, treedef = jax.tree.flatten(grads)
  if not leaves:
    return grads
  leaves[0] = leaves[0] + jnp.where(finite, 0.0, jnp.nan).astype(leaves[0].dtype)
  return jax.tree.unflatten(treedef, leaves)


def applied_updates(optimizer: nnx.Optimizer) -> jax.Array:
  """How many updates the schedule has seen (apply_if_finite does not count skipped ones)."""
  skipped = optimizer.opt_state.total_notfinite
  skipped = skipped[...] if isinstance(skipped, nnx.Variable) else skipped
  return optimizer.step[...] - skipped


def grad_names(model: nnx.Module, optimizer: nnx.Optimizer) -> list[str]:
  """Paths of the trainable leaves, in the order of metrics['grad_finite'] / ['param_finite']."""
  state = nnx.state(model, optimizer.wrt)
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]


def nonfinite_report(step: int, metrics: Mapping[str, Any], names: list[str]) -> str | None:
  """None if the step was finite, else a message naming the first non-finite tensor.

  Order of blame: a non-finite parameter (the cause), then the loss, then the
  first non-finite gradient in parameter order.
  """
  if bool(metrics["finite"]):
    return None
  bad_params = [n for n, ok in zip(names, metrics["param_finite"], strict=True) if not ok]
  bad_grads = [n for n, ok in zip(names, metrics["grad_finite"], strict=True) if not ok]
  what = (f"parameter {bad_params[0]} is non-finite" if bad_params else
          f"loss is {float(metrics['loss'])}" if not np.isfinite(float(metrics["loss"])) else
          f"gradient of {bad_grads[0]} is non-finite")
  return (f"step {step}: {what} ({len(bad_grads)} of {len(names)} gradients non-finite); the update "
          "was not applied. Lower the learning rate, check the data, or set "
          "config.train.nan_policy='skip' to skip such steps.")


jit_train_step = nnx.jit(train_step, static_argnames=("tc",), donate_argnums=(0, 1))
