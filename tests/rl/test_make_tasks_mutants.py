"""Mutation audit of experiments.make_tasks: the split, seed and per-domain level it writes and reports."""

import json
import subprocess
import sys
from pathlib import Path

from rl.tasks.task_files import load_tasks
from tests.helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[2]


def test_heldout_tasks_at_each_domains_top_level_and_the_seed(tmp_path):
  """Catches --split, --seed or the per-domain cap of --difficulty dropped (train tasks written to a
  heldout file; terminal asked for a level past its top 3), and the reported level or split
  differing from the tasks written."""
  out = tmp_path / "heldout.jsonl"
  run = subprocess.run([sys.executable, "-m", "experiments.make_tasks", "--domain=math,terminal",
                        "--split=heldout", "--difficulty=4", "--n=2", "--seed=3", f"--out={out}"],
                       cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-2000:]
  lines = run.stdout.strip().splitlines()
  assert json.loads(lines[-1]) == {"out": str(out), "split": "heldout", "tasks": 4,
                                   "domains": {"math": {"n": 2, "difficulty": 4},
                                               "terminal": {"n": 2, "difficulty": 3}}}
  assert lines[:2] == ["math           2 tasks  difficulty 4", "terminal       2 tasks  difficulty 3"]
  tasks = load_tasks(out)
  assert [t.id for t in tasks] == ["math-heldout-d4-s3-00000", "math-heldout-d4-s3-00001",
                                   "terminal-heldout-d3-s3-00000", "terminal-heldout-d3-s3-00001"]
  assert [(t.meta["split"], t.meta["difficulty"], t.meta["seed"]) for t in tasks] == \
      [("heldout", 4, 3), ("heldout", 4, 3), ("heldout", 3, 3), ("heldout", 3, 3)]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["heldout.jsonl"]


def test_out_in_a_new_folder_is_made_and_bad_out_or_seed_refused_before_generating(tmp_path):
  """--out in a folder that did not exist was a FileNotFoundError naming the hidden temp file; a folder
  as --out failed in os.replace after generating; --seed=-1 wrote ids 's-1' (config.sft.task_seed
  refuses it); an empty --out or one under a file failed after generating, with a traceback."""
  def make(*args):
    return subprocess.run([sys.executable, "-m", "experiments.make_tasks", "--domain=math", "--n=1", *args],
                          cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True, timeout=300)

  out = tmp_path / "new" / "deeper" / "m.jsonl"
  run = make(f"--out={out}")
  assert run.returncode == 0, run.stderr[-2000:]
  assert [t.id for t in load_tasks(out)] == ["math-train-d0-s0-00000"]
  (tmp_path / "afile").write_text("")
  bad_out = "--out: a file path (not empty, not a directory, not under a file)"
  for args, why in (([f"--out={tmp_path}"], bad_out), (["--out="], bad_out),
                    ([f"--out={tmp_path / 'afile' / 'x.jsonl'}"], bad_out),
                    ([f"--out={tmp_path / 'x.jsonl'}", "--seed=-1"], "--seed: an integer >= 0")):
    run = make(*args)
    assert run.returncode != 0 and why in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "new"]
