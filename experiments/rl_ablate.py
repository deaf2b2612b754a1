"""Short RL runs side by side on the same seed and budget: objectives, routing replay, any knob.

    python -m experiments.rl_ablate --workdir=/tmp/rl_ablate --init_checkpoint=/tmp/horizon_sft/checkpoints \
        --variants='grpo dr_grpo dapo gspo grpo+routing_replay=true' --steps=4 \
        --set=rl.mixture=math=1,terminal=1 --set=rl.prompts_per_step=4
    python -m experiments.rl_ablate --workdir=/tmp/abl --model=tiny --steps=2   # seconds

Each variant is `<algorithm>[+<rl knob>=<value>...]` (configs/rl.py); `--set=<dotted.path>=<value>`
applies to every variant. Neither sets rl.steps (--steps does), a checkpoint.init_from other than
--init_checkpoint, or a config.train field RL does not read (steps, global_batch, seq_len,
grad_accum); a value the field's type does not take is refused, naming the variant or --set entry.
The runs share one process, so a program compiled by the first is reused by the rest. Each run
keeps its own workdir (<workdir>/<variant>: metrics.jsonl, trajectories, checkpoints). Prints a
table of the step means (success, reward, the off-policy diagnostics |Δlogp|, rollout-vs-trainer
k3 KL, TIS and PPO clip fractions, routing mismatch, entropy, response length, step time) and,
last, one line of JSON.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import re

import ml_collections
import numpy as np

from experiments.config_util import user_errors_in_one_line
from model.config import ConfigError

COLUMNS = ("success", "reward", "abs_dlogp", "rollout_kl", "tis_clip_frac", "clip_frac", "routing_mismatch",
           "entropy", "response_tokens", "groups_dropped", "step_s")


# What each field type takes on the command line, for the errors.
_NEEDS = {bool: "true or false", int: "an int (e.g. 4)", float: "a number (e.g. 0.28, 1e-4 or inf)"}


def _value(text: str, kind: type, field: str, where: str):
  """The text as a value of the field's type: 'true' -> True, '3' -> 3, '1e-4' -> 1e-4 (an int is
  a float field's number too; nan and inf are numbers, left to the field's own range check).

  A string field keeps the text as written (`rl.difficulty=1` is the string '1', as on the
  launcher's command line). Anything the type does not take is a ConfigError naming `where`.
  """
  if kind is str:
    return text
  low = text.strip().lower()
  if kind is bool and low in ("true", "false"):
    return low == "true"
  if kind is float:
    try:
      return float(low)
    except ValueError:
      pass
  try:
    value = ast.literal_eval(text.strip())
  except (ValueError, SyntaxError):
    value = text
  if kind in _NEEDS and (type(value) is not kind):  # bool is not an int here, nor an int a bool
    raise ConfigError(f"{where}: {field}={text!r}: needs {_NEEDS[kind]}.")
  return value


def apply(config, path: str, text: str, where: str | None = None) -> None:
  """Sets config.<path> (dotted) from text; errors name `where` (the --set entry or the variant),
  the field, the value and what the field takes."""
  where = where or f"--set {path}={text}"
  *parents, leaf = path.split(".")
  node = config
  for i, name in enumerate(path.split(".")):
    if not isinstance(node, ml_collections.ConfigDict):
      raise ConfigError(f"{where}: config.{'.'.join(parents[:i])} is a value ({node!r}), not a section; "
                        f"set config.{'.'.join(parents[:i])}=<value>.")
    if name not in node:
      under = f"config.{'.'.join(parents[:i])}" if i else "the root"
      raise ConfigError(f"{where}: the config has no {name!r} under {under} (known: {sorted(node.keys())}).")
    if i < len(parents):
      node = node[name]
  kind = node.get_type(leaf)
  if kind is ml_collections.ConfigDict:
    raise ConfigError(f"{where}: config.{path} is a section, not a value; set one of its fields "
                      f"(config.{path}.<field>=<value>; known: {sorted(node[leaf].keys())}).")
  value = _value(text, kind, f"config.{path}", where)
  try:
    node[leaf] = value
  except (TypeError, ValueError) as e:
    raise ConfigError(f"{where}: config.{path}={text!r} does not fit the field ({e}).") from e


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


# --set / variant fields the ablation sets from its own flags: giving them again would run something
# else than the flag (and the summary) says.
_OWN_FLAGS = {"rl.steps": "--steps", "rl.algorithm": "the variant's algorithm (<algorithm>+knob=value)"}


def check_entry(where: str, path: str, value: str, args: argparse.Namespace) -> None:
  """A --set entry or variant knob that the ablation's own flags set, that conflicts with
  --init_checkpoint, or that RL never reads (rl/train/checks.NOT_READ_BY_RL) is refused, naming it."""
  from rl.train.checks import check_rl_overrides

  if path in _OWN_FLAGS:
    raise ConfigError(f"{where}: config.{path} is set by {_OWN_FLAGS[path]} (the same for every variant, "
                      "and what the summary reports); use that instead.")
  if path == "checkpoint.init_from" and args.init_checkpoint and value != args.init_checkpoint:
    raise ConfigError(f"{where}: --init_checkpoint={args.init_checkpoint!r} and checkpoint.init_from="
                      f"{value!r} name different starting weights; give one of them.")
  try:
    check_rl_overrides({path: value})
  except ConfigError as e:
    raise ConfigError(f"{where}: {e}") from e


def check_args(args: argparse.Namespace) -> list[str]:
  """The variants (each once, known algorithms), --model and --steps, before any config is built."""
  from configs import horizon
  from configs import rl as rl_config

  if args.steps < 1:
    raise ConfigError(f"--steps={args.steps}: must be >= 1 (the RL steps each variant runs).")
  if args.model not in horizon.VARIANTS:
    raise ConfigError(f"--model={args.model!r}: unknown; choose one of {', '.join(horizon.VARIANTS)}.")
  specs = args.variants.split()
  repeated = sorted({s for s in specs if specs.count(s) > 1})
  if not specs or repeated:
    raise SystemExit(f"--variants={args.variants!r}: give one or more variants, each once (repeated: "
                     f"{repeated}).")
  for spec in specs:
    algorithm = spec.split("+")[0]
    if algorithm not in rl_config.ALGORITHMS:
      raise ConfigError(f"variant {spec!r}: unknown algorithm {algorithm!r}; choose one of "
                        f"{', '.join(rl_config.ALGORITHMS)} (then +<rl knob>=<value>...).")
  return specs


def build_runs(args: argparse.Namespace) -> dict[str, tuple]:
  """{variant: (config, workdir)} for every variant, all checked before the first run starts.

  A typo in the last variant, a repeated variant or a workdir left by an earlier ablation
  failed only after the runs before it had finished, and printed no table.
  """
  from configs import rl as rl_config
  from rl.train.checks import check_rl_config

  specs = check_args(args)
  sets = []
  for item in args.set:
    path, sep, value = item.partition("=")
    if not sep:
      raise ConfigError(f"--set {item!r}: write --set=<dotted.path>=<value>.")
    sets.append((f"--set {item}", path, value))
  runs = {}
  for spec in specs:
    algorithm, knobs = parse_variant(spec)
    entries = sets + [(f"variant {spec!r}", path, value) for path, value in knobs]
    for where, path, value in entries:
      check_entry(where, path, value, args)
    config = rl_config.get_config(f"{algorithm},{args.model}")
    config.rl.steps = args.steps
    config.metrics.tensorboard = False
    if args.init_checkpoint:
      config.checkpoint.init_from = args.init_checkpoint
    for where, path, value in entries:
      apply(config, path, value, where)
    try:
      check_rl_config(config)  # every knob RLRun checks before it builds anything
    except ConfigError as e:
      raise ConfigError(f"variant {spec!r}: {e}") from e
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
