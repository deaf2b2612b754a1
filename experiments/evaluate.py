"""Evaluate a checkpoint, or any OpenAI- / Anthropic-compatible endpoint, on agent tasks.

    python -m experiments.evaluate --checkpoint=/tmp/horizon_sft/checkpoints \
        --domains=math,terminal --split=heldout --difficulty=0 --n=100 --out=/tmp/eval
    python -m experiments.evaluate --endpoint=http://127.0.0.1:8000 --api=anthropic \
        --tasks=/tmp/heldout.jsonl --tiers=low,high,max --samples=4 --out=/tmp/eval_api

Results go to <out>/results.jsonl, one line per episode, as they finish: run the same command
again to resume (a run whose policy, sampling or turn/token limits differ from the ones that
wrote the file is refused: use a fresh --out). Prints a markdown table (domain x tier: n,
success % with 95% Wilson interval, pass@k, reward, thinking tokens, turns, tool errors, malformed tool calls,
latency p50/p95), writes
<out>/success_vs_thinking.png, and ends with one line of JSON. Episodes the policy failed to
play (a server down, a rejected request) are not scores: they are left out of the table, named
under it, replayed by the next run of the same command, and make this one exit with status 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from experiments.config_util import model_overrides, run_app
from rl.eval import harness
from rl.eval.run import generated_tasks, run_evaluation
from rl.tasks.schema import DOMAINS
from rl.tasks.task_files import load_tasks

_DEFAULT_CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "sft.py") + ":agent"
_CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT_CONFIG, "Engine and env settings.",
                                          lock_config=True)
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Checkpoint directory (in-process engine).")
_ENDPOINT = flags.DEFINE_string("endpoint", None, "Base URL of an OpenAI/Anthropic-compatible server.")
_API = flags.DEFINE_enum("api", "openai", ["openai", "anthropic"], "API the endpoint speaks.")
_MODEL = flags.DEFINE_string("model", None,
                             "Model name for the endpoint (default: config.serving.model_name if the "
                             "server lists it at /v1/models, else the one model it lists).")
_API_KEY = flags.DEFINE_string("api_key", None, "API key for the endpoint.")
_TASKS = flags.DEFINE_string("tasks", None, "A JSONL task file (instead of the generators).")
_DOMAINS = flags.DEFINE_list("domains", list(DOMAINS), "Generated tasks: domains.")
_SPLIT = flags.DEFINE_enum("split", "heldout", ["train", "heldout"], "Generated tasks: split.")
_DIFFICULTY = flags.DEFINE_integer("difficulty", 0, "Generated tasks: level (capped per domain).")
_N = flags.DEFINE_integer("n", 20, "Generated tasks per domain (held-out: n distinct questions).")
_TIERS = flags.DEFINE_string("tiers", "high", "Thinking tiers, comma-separated: low,high,max,off.")
_SAMPLES = flags.DEFINE_integer("samples", 1, "Episodes per task and tier (pass@k for k <= samples).")
_TEMPERATURE = flags.DEFINE_float("temperature", None, "Sampling temperature (default 0 for one sample, "
                                  "else 1).")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 16, "Episodes in flight.")
_OUT = flags.DEFINE_string("out", None, "Output directory (results.jsonl resumes).", required=True)
_RANDOM_INIT = flags.DEFINE_bool("random_init", False, "Evaluate randomly initialised weights (a baseline).")


def main(argv):
  del argv
  if bool(_CHECKPOINT.value) + bool(_ENDPOINT.value) + _RANDOM_INIT.value != 1:
    raise app.UsageError("give exactly one of --checkpoint, --endpoint or --random_init")
  tasks = (load_tasks(_TASKS.value) if _TASKS.value else
           generated_tasks(_DOMAINS.value, _SPLIT.value, _DIFFICULTY.value, _N.value))
  if not tasks:
    raise app.UsageError(f"--tasks={_TASKS.value}: the file holds no tasks (one JSON task per line)."
                         if _TASKS.value else f"--domains={','.join(_DOMAINS.value)} --n={_N.value}: "
                         "no tasks to evaluate.")
  res = run_evaluation(_CONFIG.value, tasks=tasks, out_dir=_OUT.value,
                       tiers=harness.parse_tiers(_TIERS.value),
                       samples=_SAMPLES.value, concurrency=_CONCURRENCY.value, checkpoint=_CHECKPOINT.value,
                       endpoint=_ENDPOINT.value, api=_API.value, model=_MODEL.value, api_key=_API_KEY.value,
                       temperature=_TEMPERATURE.value, model_overrides=model_overrides())
  print(res["table"])
  print(f"results: {res['results']}  plot: {res['plot']}")
  print(res["json"])
  if res["not_played"]:  # an incomplete evaluation: a script must not take its numbers as final
    sys.exit(f"{sum(res['not_played'].values())} episodes were not played (the policy failed; the first: "
             f"{res['first_error']}); they are not in the table. Run the same command again to replay them.")


if __name__ == "__main__":
  run_app(main)
