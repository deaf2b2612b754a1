"""MoE routing: router scores, group-limited top-k selection, combine weights, aux losses.

Routing follows DeepSeekMoE (Dai et al., 2024, arXiv:2401.06066: fine-grained
routed experts plus always-on shared experts) and DeepSeek-V3 (arXiv:2412.19437,
sec. 2.1.2):

* Scores are sigmoid (or softmax) of the router logits, computed in f32 because
  small logit differences decide the top-k and bf16 would flip them.
* Auxiliary-loss-free balancing: a per-expert bias (model.moe.RouterBias) is
  added to the scores for *selection only*; the combine weights use the
  unbiased scores, so the bias never scales outputs. The bias update itself is
  `MoE.update_bias` (model/moe.py).
* Group-limited routing: experts are split into groups, a group is scored by
  the sum of its two best (biased) scores, and each token may only pick experts
  from its best `router_topk_groups` groups, bounding how many devices a token
  is sent to under expert parallelism.
* The complementary sequence-wise balance loss of DeepSeek-V3 (eq. 17-20) keeps
  any single sequence from collapsing onto a few experts; the router z-loss of
  ST-MoE (Zoph et al., 2022, arXiv:2202.08906) keeps logits small so the
  router stays numerically stable. Both are returned raw; their weights live in
  the training config.

All functions are pure, over arrays; `...` is any leading (batch, token) shape.

Shape legend: b batch, t token, e expert, k routed slot (one of the top-k).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


def sequence_aux_loss(scores: jax.Array, idx: jax.Array, valid: jax.Array | None = None) -> jax.Array:
  """DeepSeek-V3 complementary sequence-wise balance loss (unweighted).

  Per sequence: f_i = e / (k t) * #tokens choosing i, P_i = mean over tokens of
  scores_i / sum(scores); loss = sum_i f_i P_i, averaged over the batch. A
  perfectly balanced sequence gives 1.

  Args:
    scores: [b, t, e] f32 unbiased scores.
    idx: [b, t, k] selected expert ids.
    valid: optional bool [b, t], the real tokens (padding is False): each row's counts,
      means and t cover only its real tokens; a row without any adds 0. The batch mean
      stays over all b rows, so row micro-batches average to the whole batch's value.

  Returns:
    f32 scalar.
  """
  b, t, e = scores.shape
  k = idx.shape[-1]
  w = jnp.ones((b, t), jnp.float32) if valid is None else valid.astype(jnp.float32)
  counts = jax.vmap(lambda i, wt: jnp.bincount(i.reshape(-1), jnp.repeat(wt, k), length=e))(idx, w)  # [b, e]
  n = jnp.sum(w, axis=1)  # [b]
  denom = jnp.maximum(n, 1.0)[:, None]
  f = counts * (e / k) / denom
  s = scores.astype(jnp.float32)
  p = jnp.sum(s / jnp.sum(s, axis=-1, keepdims=True) * w[..., None], axis=1) / denom  # [b, e]
  return jnp.mean(jnp.sum(f * p, axis=-1))


def router_z_loss(logits: jax.Array, valid: jax.Array | None = None) -> jax.Array:
  """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2.

  Args:
    logits: [..., e] router logits.
    valid: optional bool [...], the real tokens: padding adds 0. The mean stays over every
      position, so row micro-batches of one shape average to the whole batch's value.

  Returns:
    f32 scalar.
  """
  z = jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))
  return jnp.mean(z if valid is None else z * valid.astype(jnp.float32))
