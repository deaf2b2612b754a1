"""Short RL runs side by side on the same seed and budget: objectives, routing replay, any knob.

    python -m experiments.rl_ablate --workdir=/tmp/rl_ablate --init_checkpoint=/tmp/horizon_sft/checkpoints \
        --variants='grpo dr_grpo dapo gspo grpo+routing_replay=true' --steps=4 \
        --set=rl.mixture=math=1,terminal=1 --set=rl.prompts_per_step=4
    python -m experiments.rl_ablate --workdir=/tmp/abl --model=tiny --steps=2   # seconds

Each variant is `<algorithm>[+<rl knob>=<value>...]` (configs/rl.py); `--set=<dotted.path>=<value>`
applies to every variant. The runs share one process, so a program compiled by the first is
reused by the rest. Each run keeps its own workdir (<workdir>/<variant>: metrics.jsonl,
trajectories, checkpoints). Prints a table of the step means (success, reward, the off-policy
diagnostics |Δlogp|, rollout-vs-trainer k3 KL, TIS and PPO clip fractions, routing mismatch,
entropy, response length, step time) and, last, one line of JSON.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import re

import numpy as np

from experiments.config_util import user_errors_in_one_line
from model.config import ConfigError

COLUMNS = ("success", "reward", "abs_dlogp", "rollout_kl", "tis_clip_frac", "clip_frac", "routing_mismatch",
           "entropy", "response_tokens", "groups_dropped", "step_s")


def _value(text: str, current):
  """'true' -> True, '3' -> 3, '1e-4' -> 1e-4, anything else the string; cast to the field's type.

  A string field keeps the text as written (`rl.difficulty=1` is the string '1', as on the
  launcher's command line).
  """
  if isinstance(current, str):
    return text
  low = text.strip().lower()
  if low in ("true", "false"):
    value = low == "true"
  else:
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = text
  if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  return value


def apply(config, path: str, text: str) -> None:
  """Sets config.<path> (dotted) from text; errors name the path."""
  *parents, leaf = path.split(".")
  node = config
  for name in parents:
    if name not in node:
      raise ConfigError(f"--set {path}: the config has no {name!r} (known: {sorted(node.keys())}).")
    node = node[name]
  if leaf not in node:
    raise ConfigError(f"--set {path}: the config has no {leaf!r} under {'.'.join(parents) or 'the root'} "
                      f"(known: {sorted(node.keys())}).")
  node[leaf] = _value(text, node[leaf])


def parse_variant(spec: str) -> tuple[str, list[tuple[str, str]]]:
  """'dapo+eps_high=0.3+kl=k3' -> ('dapo', [('rl.eps_high', '0.3'), ('rl.kl', 'k3')])."""
  algorithm, *knobs = spec.split("+")
  out = []
  for knob in knobs:
    key, sep, value = knob.partition("=")
    if not sep:
      raise ConfigError(f"variant {spec!r}: {knob!r} is not <rl knob>=<value> "
                        "(e.g. grpo+routing_replay=true).")
    out.append((key if "." in key else f"rl.{key}", value))
  return algorithm, out


def summarize(history: list[dict]) -> dict[str, float]:
  """Each column's mean over the run's steps (NaN where no step logged it)."""
  out = {}
  for c in COLUMNS:
    values = [h[c] for h in history if c in h]
    out[c] = float(np.mean(values)) if values else float("nan")
  return out


def build_runs(args: argparse.Namespace) -> dict[str, tuple]:
  """{variant: (config, workdir)} for every variant, all checked before the first run starts.

  A typo in the last variant, a repeated variant or a workdir left by an earlier ablation
  failed only after the runs before it had finished, and printed no table.
  """
  from configs import rl as rl_config
  from rl.train.checks import check_rl_config

  specs = args.variants.split()
  repeated = sorted({s for s in specs if specs.count(s) > 1})
  if not specs or repeated:
    raise SystemExit(f"--variants={args.variants!r}: give one or more variants, each once (repeated: "
                     f"{repeated}).")
  runs = {}
  for spec in specs:
    algorithm, knobs = parse_variant(spec)
    config = rl_config.get_config(f"{algorithm},{args.model}")
    config.rl.steps = args.steps
    config.metrics.tensorboard = False
    if args.init_checkpoint:
      config.checkpoint.init_from = args.init_checkpoint
    for item in args.set:
      path, sep, value = item.partition("=")
      if not sep:
        raise ConfigError(f"--set {item!r}: write --set=<dotted.path>=<value>.")
      apply(config, path, value)
    for path, value in knobs:
      apply(config, path, value)
    check_rl_config(config)  # every knob RLRun checks before it builds anything
    workdir = pathlib.Path(args.workdir) / re.sub(r"[^A-Za-z0-9_.=-]+", "_", spec)
    if workdir.exists():
      raise SystemExit(f"{workdir} exists: an ablation compares fresh runs; choose a new --workdir.")
    if any(w == workdir for _, w in runs.values()):
      raise SystemExit(f"variants {spec!r} and another both map to {workdir.name}; write them apart.")
    runs[spec] = (config, workdir)
  return runs


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workdir", required=True)
  p.add_argument("--variants", default="grpo dr_grpo dapo gspo grpo+routing_replay=true",
                 help="space-separated <algorithm>[+knob=value...]")
  p.add_argument("--model", default="agent", help="configs/rl.py variant (agent | tiny | ...)")
  p.add_argument("--steps", type=int, default=4)
  p.add_argument("--init_checkpoint", default=None)
  p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="for every variant")
  args = p.parse_args()
  from rl.train.trainer import run

  runs = build_runs(args)
  rows = {}
  for spec, (config, workdir) in runs.items():
    summary = run(config, str(workdir))
    rows[spec] = summarize(summary["history"])
    print(f"{spec}: {json.dumps(rows[spec])}", flush=True)
  print("| variant | " + " | ".join(COLUMNS) + " |")
  print("|---" * (len(COLUMNS) + 1) + "|")
  for spec, row in rows.items():
    print(f"| {spec} | " + " | ".join(f"{row[c]:.4g}" for c in COLUMNS) + " |")
  print(json.dumps({"steps": args.steps, "variants": rows}))


if __name__ == "__main__":
  with user_errors_in_one_line():
    main()
