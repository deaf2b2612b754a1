"""Everything an RL launch can check before it builds a model: config.rl, config.env, the
objective, the mixture, the tiers, and a resume against the run's own checkpoint.

`RLRun.__init__` and `experiments.rl_ablate` (for every variant, before the first run) call
`check_rl_config`; a value that used to fail only after the model and engine were built, or
after steps of rollouts (an unknown `eval_tiers` at the first held-out evaluation, before the
checkpoint), fails here naming its field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from absl import logging

from model.config import ConfigError, ModelConfig
from rl.envs.base import check_env_config
from rl.eval.harness import parse_tiers
from rl.sft.data import parse_tier_mix
from rl.train import objectives as obj_lib
from rl.train.mixture import parse_levels, parse_mixture
from serving.build import check_serve_config
from training.knobs import check_int_knobs, check_nonnegative_numbers
from training.loop import check_init_from, check_loop_config, check_resume

_KNOBS = tuple(f.name for f in dataclasses.fields(obj_lib.Objective))

# config.rl's run knobs: (name, lowest allowed value, why).
_RUN_KNOBS = (
    ("steps", 0, "the number of RL steps"),
    ("seed", 0, "it seeds the task streams and the samplers"),
    ("prompts_per_step", 1, "a step draws at least one prompt"),
    ("samples_per_prompt", 2, "the group size: group-relative advantages need two samples to compare"),
    ("max_refills", 0, "extra rounds of prompts under dynamic sampling"),
    ("max_failed_steps", 0, "0 never stops"),
    ("updates_per_step", 1, "passes over each step's batch"),
    ("micro_batch", 1, "rows per gradient micro-batch"),
    ("pad_multiple", 1, "rows are padded to a multiple of it"),
    ("trajectories_per_step", 0, "whole episodes written per step"),
    ("eval_every", 0, "0 turns held-out evaluation off"), ("eval_n", 1, "held-out tasks per domain"))

# config.rl fields that decide which episodes a step plays and how they are drawn: a resumed run
# that changed one would continue another run's streams from this run's positions.
DRAW_FIELDS = ("algorithm", "seed", "mixture", "difficulty", "tiers", "prompts_per_step",
               "samples_per_prompt", "max_refills", "dynamic_sampling", "temperature", "adaptive",
               "adaptive_floor")


@dataclasses.dataclass(frozen=True)
class RLSettings:
  """What check_rl_config parsed: the objective, tier mix, mixture, levels and held-out tiers."""
  objective: obj_lib.Objective
  tiers: Any
  mixture: dict[str, float]
  levels: dict[str, int]
  eval_tiers: list


def objective_from_config(rl) -> obj_lib.Objective:
  """config.rl.algorithm's preset with every knob config.rl sets (None keeps the preset's)."""
  return obj_lib.objective(rl.algorithm, **{k: rl.get(k) for k in _KNOBS if rl.get(k) is not None})


def check_run_knobs(rl) -> None:
  """A clear error naming the field for a run knob out of range, before any model is built.

  (A run with prompts_per_step=0 used to play and train on nothing for every step and save
  checkpoints of it.)
  """
  check_int_knobs("rl", rl, _RUN_KNOBS)
  check_nonnegative_numbers("rl", rl, ("temperature", "budget_penalty", "adaptive_floor"))
  if rl.temperature == 0:
    raise ConfigError("config.rl.temperature=0: greedy samples of a prompt are all the same episode, so "
                      "every group ties and gives no gradient; sample at a temperature > 0 (1.0 is usual).")
  if rl.adaptive and rl.adaptive_floor <= 0:
    raise ConfigError(f"config.rl.adaptive_floor={rl.adaptive_floor!r}: must be > 0 with adaptive=True "
                      "(the floor keeps every domain drawn while none has shown progress).")


# config.train fields an RL run does not read, and what sets that quantity instead.
NOT_READ_BY_RL = {
  "train.steps": "config.rl.steps",
  "train.global_batch": "config.rl.prompts_per_step x config.rl.samples_per_prompt (a step's episodes)",
  "train.seq_len": "config.serving.max_context (the longest episode)",
  "train.grad_accum": "config.rl.micro_batch (rows per gradient micro-batch)",
}


def check_rl_overrides(overrides: Mapping[str, Any]) -> None:
  """The `--config.*` values set on an RL command line (ml_collections' override values): a
  config.train field RL does not read is refused, naming what does, instead of running as if
  it had not been given."""
  ignored = [f"--config.{k} (set {NOT_READ_BY_RL[k]})" for k in overrides if k in NOT_READ_BY_RL]
  if ignored:
    them = "it" if len(ignored) == 1 else "them"
    raise ConfigError(f"{'; '.join(ignored)}: an RL run does not read {them}; drop {them}.")


def check_rl_config(config) -> RLSettings:
  """Every config.rl / config.env / config.checkpoint value an RL run reads, parsed and checked."""
  rl, env = config.rl, config.env
  check_run_knobs(rl)
  check_env_config(env)
  check_loop_config(config)  # checkpoint.every / keep, as in pretraining
  check_serve_config(config)  # the rollout engine's sizes, prefix cache and thinking budgets
  objective = objective_from_config(rl)
  if objective.aggregation == "constant" and not objective.norm_tokens:
    # Dr. GRPO divides by a constant, not the batch's length: the episode's generation budget.
    objective = dataclasses.replace(objective,
                                    norm_tokens=int(env.max_tokens_per_turn) * int(env.max_turns))
  if objective.overlong_buffer >= int(env.max_tokens_per_turn):
    raise ConfigError(f"config.rl.overlong_buffer={objective.overlong_buffer} must be below "
                      f"config.env.max_tokens_per_turn={env.max_tokens_per_turn} (the soft penalty ramps "
                      "over the last overlong_buffer tokens); lower it.")
  if rl.rollout_quantization not in ("none", "experts", "all-linear"):
    raise ConfigError(f"config.rl.rollout_quantization={rl.rollout_quantization!r}: choose none, "
                      "experts (routed experts in MXFP4) or all-linear.")
  if int(rl.pad_multiple) > int(config.serving.max_context):
    raise ConfigError(f"config.rl.pad_multiple={rl.pad_multiple} is above config.serving.max_context="
                      f"{config.serving.max_context}, the longest an episode can be: every row would be "
                      "padded past it. Use a divisor of max_context (the preset's is 128).")
  mixture = parse_mixture(rl.mixture)
  levels = parse_levels(rl.difficulty, list(mixture))
  eval_tiers = parse_tiers(rl.eval_tiers, "config.rl.eval_tiers")
  if rl.eval_every and not levels:
    raise ConfigError(f"config.rl.eval_every={rl.eval_every}: held-out evaluation draws from the mixture's "
                      f"generated domains, and config.rl.mixture={rl.mixture!r} has none (task files only); "
                      "set eval_every=0, or evaluate the checkpoints with experiments.evaluate --tasks=...")
  return RLSettings(objective, parse_tier_mix(rl.tiers, "config.rl.tiers"), mixture, levels, eval_tiers)


def check_rl_resume(config, cfg: ModelConfig, run_checkpoints: Any) -> None:
  """A run resuming from its own checkpoint, before anything is built: config.rl.steps against
  the checkpoint's step (below it, the run trained nothing and saved the last weights again under
  a smaller step), config.model as in pretraining, and the config.rl fields that decide the
  episodes (DRAW_FIELDS: refused, named); other config.rl changes are logged."""
  check_init_from(config, run_checkpoints)
  meta = check_resume(config, cfg, run_checkpoints, steps_field="rl.steps")
  if meta is None:
    return
  step = int(meta["step"])
  before = (meta.get("config") or {}).get("rl") or {}
  now = config.rl.to_dict()
  changed = {k: (before[k], now.get(k)) for k in before if k in now and before[k] != now[k] and k != "steps"}
  drawn = [f"{k} (checkpoint {v[0]!r}, now {v[1]!r})" for k, v in changed.items() if k in DRAW_FIELDS]
  if drawn:
    raise ConfigError(f"config.rl differs from the run this resumes ({run_checkpoints}, step {step}) in what "
                      f"decides its episodes: {'; '.join(drawn)}. Resume with the checkpoint's values, or "
                      "start a new --workdir from these weights with --config.checkpoint.init_from.")
  if changed:
    logging.warning("resuming %s at step %d with config.rl changed: %s", run_checkpoints, step,
                    "; ".join(f"{k} {v[0]!r} -> {v[1]!r}" for k, v in changed.items()))


def check_step_finite(step: int, metrics: Mapping[str, float], nan_policy: str) -> None:
  """config.train.nan_policy for an RL step whose loss or gradients were not finite (the update was
  skipped): 'stop' raises, 'skip' logs and goes on. (RL raised on a non-finite loss whatever the
  policy, and went on past non-finite gradients under 'stop'.)"""
  if math.isfinite(metrics.get("loss", 0.0)) and metrics.get("finite", 1.0) != 0.0:
    return
  why = f"RL step {step}: loss {metrics.get('loss')}, finite gradients {metrics.get('finite')}"
  if nan_policy == "stop":
    raise FloatingPointError(f"{why}; lower config.train.learning_rate, or set "
                             "config.train.nan_policy='skip' to skip such steps.")
  logging.warning("%s: the update was skipped (config.train.nan_policy='skip')", why)


class FailedSteps:
  """config.rl.max_failed_steps: stop after that many steps in a row in which every group failed to
  play or be graded (an engine, environment or grader failing every episode). Each such episode
  ends only itself, so without this a broken setup ran every step without an update, only warning."""

  def __init__(self, limit: int):
    self.limit, self.streak = limit, 0

  def observe(self, step: int, stats: Mapping[str, Any], first_failure: str | None) -> None:
    all_failed = stats["groups"] == 0 and stats["groups_invalid"] > 0
    self.streak = self.streak + 1 if all_failed else 0
    if self.limit and self.streak >= self.limit:
      raise RuntimeError(
        f"RL steps {step - self.streak + 1}..{step}: every group failed to play or be graded, so nothing "
        f"trained (config.rl.max_failed_steps={self.limit}); the first failure of step {step}: "
        f"{first_failure}. Fix its cause (the engine, the environments, the graders) and run the same "
        "command again to resume; max_failed_steps=0 never stops.")
