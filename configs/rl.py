"""Joint multi-domain RL (rl/train/trainer.py) on top of configs/sft.py.

    python -m experiments.rl --config=configs/rl.py:grpo --workdir=/tmp/horizon_rl \
        --config.checkpoint.init_from=/tmp/horizon_sft/checkpoints
    python -m experiments.rl --config=configs/rl.py:dapo --workdir=/tmp/rl_dapo \
        --config.rl.mixture='math=2,terminal=1' --config.rl.eps_high=0.3
    python -m experiments.rl --config=configs/rl.py:grpo,tiny --workdir=/tmp/rl_tiny   # tests

The argument is `<algorithm>[,<variant>]`: the algorithm (grpo | dr_grpo | dapo | gspo |
rloo) picks the objective's preset (rl/train/objectives.py: PRESETS) and every knob of it is
overridable here (`--config.rl.eps_high=...`); unset knobs (None) keep the preset's value.
The variant (default `agent`) picks model, engine and environment limits from configs/sft.py.
"""

import ml_collections
from ml_collections.config_dict import placeholder

from configs import sft

ALGORITHMS = ("grpo", "dr_grpo", "dapo", "gspo", "rloo")
VARIANTS = ALGORITHMS + ("grpo,tiny",)  # what tests/test_config.py builds


def _rl(algorithm: str) -> ml_collections.ConfigDict:
  r = ml_collections.ConfigDict()
  r.algorithm = algorithm
  r.steps = 40
  r.seed = 0
  # The mixture: "source=weight,..." (a domain's generator, or file:PATH.jsonl).
  r.mixture = "math=1,terminal=1,code=1,web=1,docqa=1,cad=1"
  r.difficulty = "0"  # a level for every domain, or "math=1,cad=0"
  r.adaptive = False  # move weight toward domains with learning progress (rl/train/mixture.py)
  r.adaptive_floor = 0.1
  r.tiers = "high"  # "low=1,high=1,max=1": each prompt's tier is drawn from this mix
  r.prompts_per_step = 8
  r.samples_per_prompt = 8  # the group size
  r.temperature = 1.0
  r.max_refills = 2  # dynamic sampling: extra rounds of prompts when groups are dropped
  # Stop after this many steps in a row in which every episode failed to play or be graded (a broken
  # engine, environment or grader); 0 = never stop.
  r.max_failed_steps = 3
  r.updates_per_step = 1  # passes over each step's batch (1 = on-policy)
  # One-step asynchrony: generate step n+1 (weights before update n) while updating on step n.
  r.async_rollouts = False
  # Rollouts with MXFP4 weights: "none" | "experts" | "all-linear", quantized from the policy at
  # every weight sync (the trainer stays dense; TIS corrects the difference).
  r.rollout_quantization = "none"
  r.micro_batch = 8  # rows per gradient micro-batch
  r.pad_multiple = 128  # rows are padded to a multiple of this (fewer compiled shapes)
  # Micro-batches of rows of similar length, each cut to its own longest row (rl/train/batch.py:
  # micro_batches); False pads every row to the batch's longest.
  r.group_by_length = True
  # R3 (routing replay): the trainer routes each MoE token to the experts the engine chose, so
  # rollout and training policies differ only by numerics; routing is recorded either way and
  # `routing_mismatch` reports how often the trainer's own top-k differs.
  r.routing_replay = False
  r.budget_penalty = 0.2  # reward lost when the engine forces the end of thinking
  r.trajectories_per_step = 2  # whole episodes written to <workdir>/trajectories.jsonl
  r.eval_every = 0  # held-out evaluation every N steps (and at the end); 0 = off
  r.eval_n = 20  # held-out tasks per domain
  r.eval_tiers = "high"
  # Objective knobs (None = the algorithm's preset; see rl/train/objectives.py).
  for name, kind in (("advantage", str), ("ratio", str), ("eps_low", float), ("eps_high", float),
                     ("aggregation", str), ("dynamic_sampling", bool), ("overlong_buffer", int),
                     ("overlong_penalty", float), ("kl", str), ("kl_coef", float), ("kl_place", str),
                     ("tis_cap", float), ("norm_tokens", int)):
    r[name] = placeholder(kind)
  return r


def get_config(arg: str = "grpo") -> ml_collections.ConfigDict:
  algorithm, _, variant = arg.partition(",")
  if algorithm not in ALGORITHMS:
    raise ValueError(f"configs/rl.py: unknown algorithm {algorithm!r}; choose one of {ALGORITHMS} "
                     "(e.g. --config=configs/rl.py:dapo or configs/rl.py:grpo,tiny).")
  config = sft.get_config(variant or "agent")
  config.rl = _rl(algorithm)
  # The schedule's length is config.rl.steps (the trainer sets it); a constant rate after warm-up.
  # config.train's steps, global_batch, seq_len and grad_accum are not read (a step's batch is its
  # episodes); experiments.rl refuses them on the command line (rl/train/checks.NOT_READ_BY_RL).
  config.train.update(learning_rate=1e-4, warmup_steps=2, end_lr_fraction=1.0)
  config.checkpoint.every = 10
  config.metrics.log_every = 1
  # Rollouts reuse cached prompt prefixes (the group's samples share their prompt) only where
  # that is bit-identical to a cold prefill, so a resumed run repeats its episodes exactly.
  config.serving.prefix_cache_exact = True
  if variant in ("tiny", "tiny_sharded"):  # tests: seconds-long steps
    config.rl.update(steps=3, prompts_per_step=2, samples_per_prompt=4, mixture="math=1",
                     micro_batch=4, pad_multiple=64, eval_n=4)
    config.train.update(learning_rate=1e-3)
    if algorithm == "dapo":
      config.rl.overlong_buffer = 12  # of tiny's 48 tokens per turn
    config.checkpoint.every = 1
  return config
