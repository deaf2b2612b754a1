"""experiments.make_tasks: flags are checked before anything is written; --out is replaced whole."""

import json
import subprocess
import sys
from pathlib import Path

from rl.tasks.task_files import load_tasks
from tests.helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[2]


def _make(*flags):
  return subprocess.run([sys.executable, "-m", "experiments.make_tasks", *flags], cwd=ROOT,
                        env=subprocess_env(1), capture_output=True, text=True, timeout=300)


def test_bad_flags_leave_an_existing_file_alone(tmp_path):
  out = tmp_path / "heldout.jsonl"
  good = _make("--domain=math", "--n=3", f"--out={out}")
  assert good.returncode == 0, good.stderr[-2000:]
  assert json.loads(good.stdout.strip().splitlines()[-1])["tasks"] == 3 and len(load_tasks(out)) == 3
  before = out.read_bytes()
  for flags, words in [(["--domain=math,math"], "each once"),  # wrote the file, then failed on duplicate ids
                       (["--domain="], "one or more of"),  # wrote an empty task file
                       (["--domain=math", "--n=0"], "--n: tasks per domain"),
                       (["--domain=math", "--difficulty=-1"], "--difficulty: a level >= 0")]:
    bad = _make(*flags, f"--out={out}")
    assert bad.returncode != 0 and words in bad.stderr, (flags, bad.stderr[-2000:])
    assert out.read_bytes() == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ["heldout.jsonl"]  # no temporary file left behind


