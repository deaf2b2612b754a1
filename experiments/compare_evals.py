"""Paired comparison of two evaluations of the same tasks (e.g. a checkpoint before and after RL).

    python -m experiments.evaluate --checkpoint=/tmp/sft/checkpoints --domains=math,terminal --n=200 \
        --out=/tmp/eval_before
    python -m experiments.evaluate --checkpoint=/tmp/rl/checkpoints --domains=math,terminal --n=200 \
        --out=/tmp/eval_after
    python -m experiments.compare_evals --before=/tmp/eval_before --after=/tmp/eval_after

Prints a markdown table per (domain, tier): pairs, success before and after, the difference,
tasks that flipped up / down, the paired standard error of the difference and its z, the
exact McNemar p-value, and the unpaired SE for comparison (rl/eval/compare.py), then one line
of JSON. Only episodes both runs hold are compared; runs whose sampling settings differ are
refused unless --allow_different_sampling. Episodes a run's policy failed to play (end 'error')
are not scores: they are left out and counted. z is '–' (null in the JSON) where the paired SE
is 0; McNemar's p still applies.
"""

from __future__ import annotations

import json

from absl import app, flags

from experiments.config_util import run_app
from rl.eval.compare import CompareError, compare_dirs, markdown

_BEFORE = flags.DEFINE_string("before", None, "--out directory of the baseline evaluation.", required=True)
_AFTER = flags.DEFINE_string("after", None, "--out directory of the evaluation to compare.", required=True)
_ALLOW = flags.DEFINE_bool("allow_different_sampling", False,
                           "Compare runs whose sampling settings (run.json) differ.")


def main(argv):
  del argv
  try:
    rows, unmatched = compare_dirs(_BEFORE.value, _AFTER.value, _ALLOW.value)
  except CompareError as e:
    raise app.UsageError(str(e)) from e
  print(markdown(rows))
  if unmatched["only_before"] or unmatched["only_after"]:
    print(f"not compared: {unmatched['only_before']} episodes only in --before, "
          f"{unmatched['only_after']} only in --after")
  if unmatched["unplayed_before"] or unmatched["unplayed_after"]:
    print(f"not played (policy errors, not scored; rerun that evaluation's command to replay them): "
          f"{unmatched['unplayed_before']} in --before, {unmatched['unplayed_after']} in --after")
  print(json.dumps({"rows": rows, **unmatched}))


if __name__ == "__main__":
  run_app(main)
