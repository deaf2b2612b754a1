"""Policy-gradient objectives of the GRPO family as orthogonal knobs, and the presets that name them.

A batch holds G samples of each of several prompts (a *group*: same task, same tier). Every
knob is independent; `PRESETS` fixes documented defaults per algorithm and any run may
override a single knob (`config.rl.<knob>`):

  advantage      'group_norm'  (r - mean) / (std + eps) within the group        GRPO, DAPO, GSPO
                 'group_mean'  r - mean (no std: no difficulty re-weighting)      Dr. GRPO
                 'loo'         r - mean of the *other* G-1 samples                RLOO
  ratio          'token'       pi/pi_old per token                                GRPO, DAPO, RLOO
                 'sequence'    exp(mean_t log pi/pi_old): the length-normalised    GSPO
                               sequence ratio, one per sample
  eps_low/high   clip range [1 - eps_low, 1 + eps_high]; eps_high > eps_low is
                 DAPO's clip-higher (GSPO's ranges are ~1e-4: a sequence ratio)
  aggregation    'token_mean'  sum of token losses / tokens in the batch           DAPO, RLOO
                 'seq_mean'    mean over samples of each sample's token mean       GRPO, GSPO
                 'constant'    sum of token losses / (samples x norm_tokens)       Dr. GRPO
  dynamic_sampling  drop groups whose rewards are all equal (no signal), refill   DAPO
  overlong       soft penalty over the last `overlong_buffer` tokens before the
                 generation limit, down to -overlong_penalty at the limit          DAPO
  kl             'none' | 'k1' | 'k3' to a frozen reference, `kl_coef`, applied
                 'in_loss' (a loss term) or 'in_reward' (k1 subtracted per sample)

Off-policy correction (truncated importance sampling, TIS): the engine's sampling
log-probabilities (`logp_rollout`) differ from the trainer's recomputation (`logp_old`,
different kernels and precision); each token's loss is weighted by
min(exp(logp_old - logp_rollout), tis_cap), a constant in the gradient.

Shapes: B samples, T tokens (right-padded); `mask` [B, T] is 1 on tokens the policy sampled
(tool results, prompts and forced tokens are 0 and get no gradient).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ConfigError

ALGORITHMS = ("grpo", "dr_grpo", "dapo", "gspo", "rloo")
ADVANTAGES = ("group_norm", "group_mean", "loo")
RATIOS = ("token", "sequence")
AGGREGATIONS = ("token_mean", "seq_mean", "constant")
KLS = ("none", "k1", "k3")
KL_PLACES = ("in_loss", "in_reward")


@dataclasses.dataclass(frozen=True)
class Objective:
  """Every knob of the loss (see the module docstring)."""

  advantage: str = "group_norm"
  ratio: str = "token"
  eps_low: float = 0.2
  eps_high: float = 0.2
  aggregation: str = "seq_mean"
  dynamic_sampling: bool = False
  overlong_buffer: int = 0  # tokens before the limit where the soft penalty ramps; 0 = off
  overlong_penalty: float = 1.0
  kl: str = "none"
  kl_coef: float = 0.0
  kl_place: str = "in_loss"
  tis_cap: float = 2.0  # 0 = no TIS weighting
  norm_tokens: int = 0  # 'constant' aggregation's divisor per sample (0: the batch's T; the RL
  # trainer sets the episode's generation budget, max_tokens_per_turn x max_turns)
  adv_eps: float = 1e-6

  def __post_init__(self):
    for name, allowed in (("advantage", ADVANTAGES), ("ratio", RATIOS), ("aggregation", AGGREGATIONS),
                          ("kl", KLS), ("kl_place", KL_PLACES)):
      if getattr(self, name) not in allowed:
        raise ConfigError(f"config.rl.{name}={getattr(self, name)!r}: choose one of {', '.join(allowed)}.")
    self._check_ranges()
    self._check_knobs_take_effect()

  def _check_ranges(self):
    # eps_high and tis_cap may be inf on purpose (no upper clip / untruncated importance weights);
    # an infinite kl_coef, overlong_penalty or adv_eps turns the loss or the advantages into NaN.
    for name in ("eps_low", "eps_high", "kl_coef", "tis_cap", "overlong_penalty"):
      value = getattr(self, name)
      if not value >= 0 or (name not in ("eps_high", "tis_cap") and not math.isfinite(value)):
        bound = ">= 0 (inf: no cap)" if name in ("eps_high", "tis_cap") else "a finite number >= 0"
        raise ConfigError(f"config.rl.{name}={value!r}: must be {bound}.")
    if self.eps_low >= 1:
      raise ConfigError(f"config.rl.eps_low={self.eps_low}: must be < 1 "
                        "(the ratio's lower clip 1 - eps_low).")
    if not 0 < self.adv_eps < math.inf:  # not a config.rl knob: (r - mean) / (std + adv_eps)
      raise ConfigError(f"Objective.adv_eps={self.adv_eps!r}: must be finite and > 0 (a group whose rewards "
                        "all tie has std 0).")
    if self.overlong_buffer < 0 or self.norm_tokens < 0:
      raise ConfigError("config.rl.overlong_buffer and config.rl.norm_tokens must be >= 0.")

  def _check_knobs_take_effect(self):
    """A knob that the other knobs switch off would be accepted and silently do nothing."""
    if self.kl != "none" and self.kl_coef == 0:
      raise ConfigError(f"config.rl.kl={self.kl!r} with config.rl.kl_coef=0: the KL term would have no "
                        "effect (yet the reference model is still built and scored every step); set "
                        "config.rl.kl_coef > 0 (e.g. 0.05) or config.rl.kl=none.")
    if self.kl == "none" and self.kl_coef > 0:
      raise ConfigError(f"config.rl.kl_coef={self.kl_coef} with config.rl.kl='none': there is no KL term "
                        "to weight; set config.rl.kl=k1 or k3, or drop kl_coef.")
    if self.kl == "none" and self.kl_place != "in_loss":
      raise ConfigError(f"config.rl.kl_place={self.kl_place!r} with config.rl.kl='none': there is no KL "
                        "term to place; set config.rl.kl=k1 or k3, or drop kl_place.")
    if self.norm_tokens and self.aggregation != "constant":
      raise ConfigError(f"config.rl.norm_tokens={self.norm_tokens} is used only by "
                        f"config.rl.aggregation='constant' (this objective's is {self.aggregation!r}); drop "
                        "it or set config.rl.aggregation=constant.")


PRESETS: Mapping[str, Mapping[str, Any]] = {
  # Shao et al. 2024 (DeepSeekMath): group-normalised advantages, token ratios, per-sample means.
  "grpo": dict(advantage="group_norm", ratio="token", eps_low=0.2, eps_high=0.2, aggregation="seq_mean"),
  # Liu et al. 2025 (Understanding R1-Zero-like training): no std, no length normalisation.
  "dr_grpo": dict(advantage="group_mean", ratio="token", eps_low=0.2, eps_high=0.2, aggregation="constant"),
  # Yu et al. 2025 (DAPO): clip-higher, token-level mean, dynamic sampling, overlong shaping.
  "dapo": dict(advantage="group_norm", ratio="token", eps_low=0.2, eps_high=0.28, aggregation="token_mean",
               dynamic_sampling=True, overlong_buffer=64, overlong_penalty=1.0),
  # Zheng et al. 2025 (GSPO): the length-normalised sequence ratio with a narrow clip.
  "gspo": dict(advantage="group_norm", ratio="sequence", eps_low=3e-4, eps_high=4e-4, aggregation="seq_mean"),
  # Ahmadian et al. 2024 (Back to basics): leave-one-out baseline, PPO-clipped token ratios.
  "rloo": dict(advantage="loo", ratio="token", eps_low=0.2, eps_high=0.2, aggregation="token_mean"),
}


def objective(algorithm: str, **overrides: Any) -> Objective:
  """The preset of `algorithm` with `overrides` (None values keep the preset's)."""
  if algorithm not in PRESETS:
    raise ConfigError(f"config.rl.algorithm={algorithm!r}: choose one of {', '.join(ALGORITHMS)}.")
  unknown = set(overrides) - {f.name for f in dataclasses.fields(Objective)}
  if unknown:
    raise ConfigError(f"unknown objective knob(s) {sorted(unknown)}; knobs: "
                      f"{', '.join(f.name for f in dataclasses.fields(Objective))}.")
  overrides = {k: v for k, v in overrides.items() if v is not None}
  obj = Objective(**{**PRESETS[algorithm], **overrides})
  # Objective's default overlong_penalty (1.0) waits for an overlong_buffer; one the run sets
  # while the buffer is 0 would do nothing.
  if overrides.get("overlong_penalty", 0) > 0 and obj.overlong_buffer == 0:
    raise ConfigError(f"config.rl.overlong_penalty={overrides['overlong_penalty']} with "
                      f"config.rl.overlong_buffer=0 ({algorithm}): the penalty ramps over the last "
                      "overlong_buffer tokens before the limit, so it would never apply; set "
                      "config.rl.overlong_buffer > 0 (e.g. 64) or drop overlong_penalty.")
  return obj


# ---- rewards and advantages (host side, NumPy: a handful of numbers per sample) -----------------


def overlong_penalty(lengths: np.ndarray, max_tokens: int, obj: Objective) -> np.ndarray:
  """DAPO's soft overlong punishment per sample: 0 up to max_tokens - buffer, then a linear ramp
  to -overlong_penalty at max_tokens (and beyond)."""
  lengths = np.asarray(lengths, np.float64)
  if obj.overlong_buffer <= 0:
    return np.zeros_like(lengths)
  start = max_tokens - obj.overlong_buffer
  return -obj.overlong_penalty * np.clip((lengths - start) / obj.overlong_buffer, 0.0, 1.0)


def advantages(rewards: np.ndarray, groups: np.ndarray, obj: Objective) -> np.ndarray:
  """One advantage per sample from its group's rewards ([B] rewards, [B] group ids)."""
  rewards = np.asarray(rewards, np.float64)
  groups = np.asarray(groups)
  out = np.zeros_like(rewards)
  for g in np.unique(groups):
    idx = np.flatnonzero(groups == g)
    r = rewards[idx]
    if obj.advantage == "loo":
      out[idx] = r - (r.sum() - r) / (len(r) - 1) if len(r) > 1 else 0.0
    else:
      out[idx] = r - r.mean()
      if obj.advantage == "group_norm":
        out[idx] /= r.std() + obj.adv_eps
  return out


def informative_groups(rewards: np.ndarray, groups: np.ndarray) -> np.ndarray:
  """bool [B]: samples whose group's rewards are not all equal (dynamic sampling keeps these)."""
  rewards, groups = np.asarray(rewards), np.asarray(groups)
  keep = np.zeros(len(rewards), bool)
  for g in np.unique(groups):
    idx = np.flatnonzero(groups == g)
    keep[idx] = np.ptp(rewards[idx]) > 0
  return keep


def kl_reward_penalty(logp_rollout: np.ndarray, logp_ref: np.ndarray, mask: np.ndarray,
                      obj: Objective) -> np.ndarray:
  """kl_place='in_reward': kl_coef x the sample's summed KL estimate, subtracted from its reward."""
  if obj.kl == "none" or obj.kl_place != "in_reward":
    return np.zeros(len(mask))
  per_token = np.asarray(kl_estimate(jnp.asarray(logp_rollout), jnp.asarray(logp_ref), obj.kl), np.float64)
  return obj.kl_coef * np.sum(per_token * np.asarray(mask, np.float64), axis=1)


# ---- the loss (device side, differentiated through logp) ----------------------------------------


def kl_estimate(logp: jax.Array, logp_ref: jax.Array, kind: str) -> jax.Array:
  """Per-token KL(pi || ref) estimators of Schulman (2020): k1 = log pi/ref, k3 = e^-d + d - 1."""
  d = logp - logp_ref
  if kind == "k1":
    return d
  if kind == "k3":
    return jnp.exp(-d) + d - 1.0
  raise ValueError(f"kl estimator {kind!r}: choose k1 or k3.")


def token_weights(mask: np.ndarray, obj: Objective) -> np.ndarray:
  """f32 [B, T] weights w with loss = sum(per_token * w): the aggregation as one linear map, so a
  batch split into micro-batches (rows) sums to exactly the whole batch's loss."""
  mask = np.asarray(mask, np.float64)
  if obj.aggregation == "token_mean":
    w = mask / max(mask.sum(), 1.0)
  elif obj.aggregation == "seq_mean":
    w = mask / np.maximum(mask.sum(1, keepdims=True), 1.0) / len(mask)
  else:
    w = mask / (len(mask) * (obj.norm_tokens or mask.shape[1]))
  return w.astype(np.float32)


def _aggregate(per_token: jax.Array, mask: jax.Array, obj: Objective) -> jax.Array:
  if obj.aggregation == "token_mean":
    return jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0)
  per_sample = jnp.sum(per_token * mask, axis=1)
  if obj.aggregation == "seq_mean":
    return jnp.mean(per_sample / jnp.maximum(jnp.sum(mask, axis=1), 1.0))
  norm = obj.norm_tokens or per_token.shape[1]
  return jnp.sum(per_sample) / (per_token.shape[0] * norm)


def policy_loss(logp: jax.Array, batch: Mapping[str, jax.Array], obj: Objective
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The clipped surrogate loss and its diagnostics.

  Args:
    logp: f32 [B, T] the trainer's log-probabilities of the sampled tokens (differentiated).
    batch: mask [B, T] (1 = a sampled token), advantages [B], logp_old [B, T] (the trainer's
      log-probs before this update; equal to logp on the first pass), logp_rollout [B, T]
      (the engine's), optional logp_ref [B, T] (a frozen reference, for kl='..' in_loss),
      optional weights [B, T] (`token_weights` of the whole batch when this is a micro-batch).
    obj: the knobs.

  Returns:
    (loss, metrics): clip_frac (tokens or samples whose ratio was clipped and whose clipped
    branch was taken), tis_clip_frac (tokens whose TIS weight hit the cap), kl (the k3
    rollout-vs-trainer KL), abs_dlogp (mean |logp_old - logp_rollout|), and the reference KL.
  """
  mask = batch["mask"].astype(jnp.float32)
  adv = batch["advantages"].astype(jnp.float32)[:, None]
  logp_old = batch["logp_old"].astype(jnp.float32)
  logp_rollout = batch["logp_rollout"].astype(jnp.float32)
  n_tok = jnp.maximum(jnp.sum(mask), 1.0)

  log_ratio = logp - logp_old
  if obj.ratio == "token":
    ratio = jnp.exp(log_ratio)
  else:  # GSPO: s = exp(mean_t log ratio); per token s carries the gradient of the mean log ratio
    mean_lr = jnp.sum(log_ratio * mask, axis=1, keepdims=True) / jnp.maximum(
        jnp.sum(mask, axis=1, keepdims=True), 1.0)
    ratio = jnp.broadcast_to(jnp.exp(mean_lr), logp.shape)
  clipped = jnp.clip(ratio, 1.0 - obj.eps_low, 1.0 + obj.eps_high)
  surrogate = jnp.minimum(ratio * adv, clipped * adv)
  per_token = -surrogate

  delta = jax.lax.stop_gradient(logp_old - logp_rollout)
  if obj.tis_cap > 0:
    w = jnp.minimum(jnp.exp(delta), obj.tis_cap)
    per_token = per_token * w
    tis_clip = jnp.sum((jnp.exp(delta) > obj.tis_cap) * mask) / n_tok
  else:
    tis_clip = jnp.zeros(())
  if "weights" in batch:  # the whole batch's aggregation (token_weights), for micro-batches
    agg = lambda x: jnp.sum(x * batch["weights"])  # noqa: E731
  else:
    agg = lambda x: _aggregate(x, mask, obj)  # noqa: E731
  loss = agg(per_token)

  metrics = {}
  if obj.kl != "none" and obj.kl_place == "in_loss":
    kl_ref = kl_estimate(logp, batch["logp_ref"].astype(jnp.float32), obj.kl)
    loss = loss + obj.kl_coef * agg(kl_ref)
    metrics["kl_ref"] = jnp.sum(kl_ref * mask) / n_tok
  taken = jnp.where(adv > 0, ratio > 1.0 + obj.eps_high, (adv < 0) & (ratio < 1.0 - obj.eps_low))
  metrics.update(
    clip_frac=jnp.sum(jax.lax.stop_gradient(taken) * mask) / n_tok,
    tis_clip_frac=tis_clip,
    # KL(rollout || trainer) from the rollout's own samples (k3 with r = pi_old / pi_rollout).
    rollout_kl=jnp.sum(kl_estimate(logp_rollout, logp_old, "k3") * mask) / n_tok,
    abs_dlogp=jnp.sum(jnp.abs(delta) * mask) / n_tok,
  )
  return loss, metrics
