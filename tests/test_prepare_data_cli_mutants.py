"""Mutation audit of experiments.prepare_data: which of a flag, config.data and the default it uses."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_flags_config_data_and_defaults(tmp_path):
  """Catches a falsy flag read as unset (--max_docs=0, 'all', lost to config.data.max_docs=2), an
  empty config.data.prepared_dir taken as the output instead of data/prepared/<variant>,
  config.data.tokenizer ignored and --docs_per_shard ignored."""
  docs = tmp_path / "docs"
  docs.mkdir()
  for i in range(3):
    (docs / f"d{i}.txt").write_text(f"document number {i}: some words to tokenize\n")
  tok = tmp_path / "my tok.json"
  shutil.copy(ROOT / "training" / "assets" / "tokenizer_tiny.json", tok)
  cmd = [sys.executable, "-m", "experiments.prepare_data", f"--config={ROOT}/configs/pretrain.py:tiny",
         f"--config.data.sources=text:{docs}/*.txt=1.0", "--config.data.max_docs=2", "--max_docs=0",
         f"--config.data.tokenizer={tok}", "--docs_per_shard=1"]
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-2000:]
  result = json.loads(run.stdout.strip().splitlines()[-1])
  assert (result["out"], result["tokenizer"]) == ("data/prepared/tiny", str(tok))
  assert {k: result["sources"]["text_0"][k] for k in ("documents", "shards", "weight")} == \
      {"documents": 3, "shards": 3, "weight": 1.0}
  shards = sorted(p.name for p in (tmp_path / "data" / "prepared" / "tiny").rglob("*.arrayrecord"))
  assert len(shards) == 3


def test_tokenizer_errors_are_one_line_naming_the_flag_that_works(tmp_path):
  """A variant without a bundled tokenizer was a traceback whose hint, --config.data.tokenizer, is
  refused on configs/horizon.py (no data section); the flag that works is --tokenizer."""
  cmd = [sys.executable, "-m", "experiments.prepare_data", f"--config={ROOT}/configs/horizon.py:full",
         f"--out={tmp_path / 'out'}", "--max_docs=1"]
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
  assert "FATAL TokenizerError: no bundled tokenizer for variant 'full'" in run.stderr
  assert "pass --tokenizer=PATH" in run.stderr and not (tmp_path / "out").exists()
