"""Where an RL step's time goes: generation, environments, log-prob recompute, update, weight sync.

    python -m experiments.bench.rl_step                                  # agent variant, GRPO
    python -m experiments.bench.rl_step --config=grpo,tiny --steps=3      # seconds, tiny model
    python -m experiments.bench.rl_step --init_checkpoint=/tmp/horizon_sft/checkpoints

Runs `--steps` steps of rl/train/trainer.py (the first is reported apart: it compiles) and
prints per step: rollout wall time (generation with tools overlapped), environment busy time
(summed over episodes, overlapping generation), scoring (logp_old), the update, the weight
sync, generated tokens/s and trained tokens/s; then one line of JSON with the mean shares.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="grpo", help="configs/rl.py argument: <algorithm>[,<variant>]")
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--init_checkpoint", default=None)
  p.add_argument("--mixture", default=None, help="config.rl.mixture (default: the config's)")
  args = p.parse_args()
  from configs import rl as rl_config
  from rl.train.trainer import RLRun
  from sharding import mesh as mesh_lib

  config = rl_config.get_config(args.config)
  config.rl.steps = args.steps
  config.metrics.tensorboard = False
  if args.init_checkpoint:
    config.checkpoint.init_from = args.init_checkpoint
  if args.mixture:
    config.rl.mixture = args.mixture
  rows = []
  with tempfile.TemporaryDirectory() as workdir, mesh_lib.activate(mesh_lib.make_mesh(config.mesh)):
    r = RLRun(config, workdir)
    r.build()
    try:
      for step in range(args.steps):
        t0 = time.perf_counter()
        episodes, _, stats = r.rollout(step)
        roll = time.perf_counter() - t0
        m = r.update(episodes)
        total = time.perf_counter() - t0
        rows.append({"step": step, "total_s": total, "rollout_s": roll, "env_busy_s": stats["env_busy_s"],
                     "score_s": m["score_s"], "update_s": m["update_s"], "sync_s": m["sync_s"],
                     "episodes": len(episodes), "generated_tokens": stats["generated_tokens"],
                     "trained_tokens": m["tokens"], "batch_len": m["batch_len"]})
    finally:
      r.close()
  cols = ("step", "total_s", "rollout_s", "env_busy_s", "score_s", "update_s", "sync_s", "episodes",
          "generated_tokens")
  print(f"config {args.config}: {config.rl.prompts_per_step} prompts x {config.rl.samples_per_prompt} "
        f"samples, mixture {config.rl.mixture}")
  print(" ".join(f"{c:>16}" for c in cols) + f" {'gen tok/s':>10}")
  for r_ in rows:
    print(" ".join(f"{r_[c]:>16.2f}" if isinstance(r_[c], float) else f"{r_[c]:>16}" for c in cols)
          + f" {r_['generated_tokens'] / r_['total_s']:>10.1f}")
  steady = rows[1:] or rows
  keys = ("total_s", "rollout_s", "env_busy_s", "score_s", "update_s", "sync_s", "generated_tokens",
          "trained_tokens")
  mean = {k: float(np.mean([r_[k] for r_ in steady])) for k in keys}
  share = {f"{k}_share": mean[k] / mean["total_s"] for k in ("rollout_s", "score_s", "update_s", "sync_s")}
  print(json.dumps({"config": args.config, "steps": args.steps, "steady_steps": len(steady), **mean, **share,
                    "gen_tokens_per_s": mean["generated_tokens"] / mean["total_s"],
                    "trained_tokens_per_s": mean["trained_tokens"] / mean["total_s"],
                    "first_step_s": rows[0]["total_s"]}))


if __name__ == "__main__":
  main()
