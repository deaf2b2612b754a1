"""Write task files (JSONL, the schema of rl/tasks/schema.py) from the built-in generators.

    python -m experiments.make_tasks --domain=math --split=train --difficulty=0 --n=200 --out=/tmp/math.jsonl
    python -m experiments.make_tasks --domain=math,code,terminal,web,docqa,cad --split=heldout \
        --difficulty=1 --n=50 --out=/tmp/heldout.jsonl

Each task carries its oracle trajectory. Prints the count per domain; last line JSON.
"""

import json
import os
from pathlib import Path

from absl import flags

from experiments.config_util import run_app
from rl.tasks import generators
from rl.tasks.schema import DOMAINS
from rl.tasks.task_files import load_tasks, write_tasks

_DOMAIN = flags.DEFINE_list("domain", None, f"Domains, comma-separated: {', '.join(DOMAINS)}.", required=True)
_SPLIT = flags.DEFINE_enum("split", "train", list(generators.SPLITS),
                           "Split (tasks of the two share nothing).")
_DIFFICULTY = flags.DEFINE_integer("difficulty", 0, "Level (capped at each domain's top level).")
_N = flags.DEFINE_integer("n", 100, "Tasks per domain.")
_SEED = flags.DEFINE_integer("seed", 0, "Generator seed.")
_OUT = flags.DEFINE_string("out", None, "Output JSONL path.", required=True)
flags.register_validator("domain", lambda ds: bool(ds) and sorted(set(ds) & set(DOMAINS)) == sorted(ds),
                         f"--domain: one or more of {', '.join(DOMAINS)}, each once")
flags.register_validator("n", lambda n: n >= 1, "--n: tasks per domain, an integer >= 1")
flags.register_validator("difficulty", lambda d: d >= 0, "--difficulty: a level >= 0 (0 is the easiest)")
flags.register_validator("seed", lambda s: s >= 0, "--seed: an integer >= 0 (as config.sft.task_seed)")


def _writable_file_path(path: str) -> bool:
  """A file name (not empty, not a directory) whose nearest existing parent is a directory: the
  tasks are generated before they are written, so what cannot be written is refused first."""
  if not path.strip() or os.path.isdir(path) or path.endswith(os.sep):
    return False
  parent = Path(path).absolute().parent
  while not parent.exists():
    parent = parent.parent
  return parent.is_dir()


flags.register_validator("out", _writable_file_path,
                         "--out: a file path (not empty, not a directory, not under a file)")


def main(argv):
  del argv
  tasks, counts = [], {}
  for domain in _DOMAIN.value:
    level = min(_DIFFICULTY.value, generators.max_difficulty(domain))
    made = generators.generate(domain, split=_SPLIT.value, difficulty=level, n=_N.value, seed=_SEED.value)
    counts[domain] = {"n": len(made), "difficulty": level}
    tasks += made
  # Written beside --out and read back under the public schema before it replaces --out, so a
  # failure never leaves a half-written or invalid file where a good one was.
  out = Path(_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
  try:
    write_tasks(tasks, tmp)
    load_tasks(tmp)
    os.replace(tmp, out)
  finally:
    tmp.unlink(missing_ok=True)
  for domain, c in counts.items():
    print(f"{domain:<9} {c['n']:>6} tasks  difficulty {c['difficulty']}")
  print(json.dumps({"out": _OUT.value, "split": _SPLIT.value, "tasks": len(tasks), "domains": counts}))


if __name__ == "__main__":
  run_app(main)
