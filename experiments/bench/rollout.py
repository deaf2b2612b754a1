"""Agent rollouts through the in-process engine: 32 episodes in flight vs 1.

    python -m experiments.bench.rollout                      # agent variant, random weights
    python -m experiments.bench.rollout --checkpoint=/tmp/horizon_sft/checkpoints --quick

Plays the same kind of episodes (math and terminal tasks, the real environments and sandbox,
the thinking tier 'low') with one episode at a time and with 32 at once through the engine's
continuous batching, in one process, and reports episodes/s and generated tokens/s. A table,
then one line of JSON with the ratios (goal: >= 8x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from rl.agent.executor import ThreadExecutor
from rl.agent.loop import run_episodes
from rl.agent.policy import Sampling
from rl.envs.base import EnvContext
from rl.eval.run import engine_policy, generated_tasks


def _measure(policy, executor, tasks, concurrency: int, max_tokens: int) -> dict:
  jobs = [(t, "low", Sampling(temperature=1.0, seed=i, max_tokens_per_turn=max_tokens))
          for i, t in enumerate(tasks)]
  t0 = time.perf_counter()
  eps = asyncio.run(run_episodes(jobs, policy, executor, concurrency=concurrency))
  dt = time.perf_counter() - t0
  gen = sum(ep.generated_tokens for ep in eps)
  return {"in_flight": concurrency, "episodes": len(eps), "seconds": dt, "episodes_per_s": len(eps) / dt,
          "gen_tokens_per_s": gen / dt, "turns": sum(ep.num_turns for ep in eps) / len(eps),
          "tool_calls": sum(ep.tool_calls for ep in eps)}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--variant", default="agent")
  p.add_argument("--checkpoint", default=None)
  p.add_argument("--max_tokens", type=int, default=64, help="generated tokens per turn")
  p.add_argument("--quick", action="store_true", help="fewer episodes")
  args = p.parse_args()
  from configs import sft
  config = sft.get_config(args.variant)
  policy, engine = engine_policy(config, args.checkpoint)
  executor = ThreadExecutor(EnvContext(), workers=16)
  n_one, n_many = (4, 32) if args.quick else (8, 96)
  try:
    math, terminal = (generated_tasks([d], "heldout", 0, n_many // 2) for d in ("math", "terminal"))
    tasks = [t for pair in zip(math, terminal, strict=True) for t in pair]  # both runs: the same mix
    _measure(policy, executor, tasks[:2], 2, args.max_tokens)  # compile the engine's programs
    one = _measure(policy, executor, tasks[:n_one], 1, args.max_tokens)
    many = _measure(policy, executor, tasks[:n_many], 32, args.max_tokens)
  finally:
    executor.shutdown()
    engine.stop()
  print(f"engine: {engine.slots} slots x {engine.max_context} tokens, {args.variant}, "
        f"{'checkpoint ' + args.checkpoint if args.checkpoint else 'random weights'}")
  head = (("in flight", 9), ("episodes", 8), ("seconds", 8), ("episodes/s", 11), ("gen tok/s", 10),
          ("turns/ep", 9))
  print(" ".join(f"{name:>{w}}" for name, w in head))
  for r in (one, many):
    print(f"{r['in_flight']:>9} {r['episodes']:>8} {r['seconds']:>8.1f} {r['episodes_per_s']:>11.3f} "
          f"{r['gen_tokens_per_s']:>10.1f} {r['turns']:>9.2f}")
  print(json.dumps({"variant": args.variant, "one": one, "many": many,
                    "episodes_per_s_ratio": many["episodes_per_s"] / one["episodes_per_s"],
                    "gen_tokens_per_s_ratio": many["gen_tokens_per_s"] / one["gen_tokens_per_s"]}))


if __name__ == "__main__":
  main()
