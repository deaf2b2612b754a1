"""Mutation audit of experiments.train_tokenizer: the flags it honours and the configs it refuses."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _train(*flags):
  cmd = [sys.executable, "-m", "experiments.train_tokenizer", "--config=configs/horizon.py:tiny", *flags]
  return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_max_digits_zero_is_refused_not_read_as_the_default(tmp_path):
  """Defect: --max_digits=0 (outside the documented 1-3) trained with the default 3 and reported
  max_digits 3; it is refused before any training, and nothing is written."""
  run = _train(f"--out={tmp_path / 'tok.json'}", "--max_digits=0")
  assert run.returncode != 0, run.stdout[-2000:]
  assert "--max_digits: max_digits=0: choose 1, 2 or 3" in run.stderr, run.stderr[-2000:]
  assert not list(tmp_path.iterdir())


def test_the_smallest_corpus_and_max_digits_are_honoured(tmp_path):
  """Catches --max_bytes=65536 (the documented least) refused, --max_digits ignored for the
  variant's default, and a rebuild of the same file refused as if its contents differed; the
  vocabulary is 256 bytes + 60 merges + 15 special tokens = 331 ids."""
  out = tmp_path / "tok.json"
  run = _train(f"--out={out}", "--max_bytes=65536", "--max_digits=2", "--heldout_bytes=1000")
  assert run.returncode == 0, run.stderr[-2000:]
  result = json.loads(run.stdout.strip().splitlines()[-1])
  got = (result["vocab_size"], result["merges"], result["train_bytes"], result["max_digits"])
  assert got == (331, 60, 65536, 2)
  assert r"\\p{N}{1,2}" in out.read_text()  # the saved split pattern: digit runs of at most 2
  first = out.read_bytes()
  again = _train(f"--out={out}", "--max_bytes=65536", "--max_digits=2", "--heldout_bytes=1000")
  assert again.returncode == 0, again.stderr[-2000:]  # the same file rebuilt: deterministic, allowed
  assert out.read_bytes() == first


def test_an_image_token_id_other_than_the_last_is_refused(tmp_path):
  """Catches the <|image|> id check dropped: a tokenizer whose <|image|> is not the config's was written."""
  run = _train(f"--out={tmp_path / 'tok.json'}", "--max_bytes=65536", "--heldout_bytes=1000",
               "--config.model.image_token_id=329")
  assert run.returncode != 0 and "<|image|> = 330, but the config has" in run.stderr, run.stderr[-2000:]
  assert "Nothing was written." in run.stderr and not list(tmp_path.iterdir())


def test_a_held_out_set_the_corpus_cannot_give_is_refused_before_training(tmp_path):
  """Defect: --heldout_bytes past what lies after --max_bytes trained and wrote the tokenizer, then
  ended in a ValueError traceback (exit 1 with the file written); it is refused before training."""
  run = _train(f"--out={tmp_path / 'tok.json'}", "--max_bytes=65536", "--heldout_bytes=1000000000000")
  assert run.returncode != 0, run.stdout[-2000:]
  assert "--max_bytes=65536 / --heldout_bytes=1000000000000: only " in run.stderr, run.stderr[-2000:]
  assert "Traceback" not in run.stderr and not list(tmp_path.iterdir())


def test_an_out_that_cannot_be_a_file_and_no_held_out_bytes_are_refused_before_training(tmp_path):
  """An --out that is a directory, or under a file, trained first and then failed with a traceback
  (IsADirectoryError / FileExistsError); --heldout_bytes=0 or -5 measured one whole file."""
  (tmp_path / "afile").write_text("x")
  for flag, says in ((f"--out={tmp_path}", "is a directory; give the tokenizer file's path"),
                     (f"--out={tmp_path / 'afile' / 'tok.json'}", "afile is a file, not a directory"),
                     (f"--out={tmp_path / 'tok.json'}", "--heldout_bytes=0: must be >= 1")):
    run = _train(flag, "--heldout_bytes=0" if "must be" in says else "--heldout_bytes=1000")
    assert run.returncode != 0 and says in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
