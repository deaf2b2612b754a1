"""The shapes VQA run (training/shapes_vqa.py, experiments/shapes_vqa.py).

Fast: bad arguments, config fields and command lines are refused before the
model is built, naming the flag or field; the arguments set config.train's
fields through TrainConfig's checks.

Slow: `tiny` trained on procedural shapes VQA answers held-out colour questions
well above chance. Runs `python -m experiments.shapes_vqa` (defaults: 600 steps
of 32 examples, ~2-4 min on 2 CPU cores) and reads its last JSON line. Measured
colour accuracy on 100 held-out colour questions: 0.51 (600 steps), 0.50
(1000), 0.56 (1500, image-first layout); chance is 1/6. The threshold, 0.35, is
twice chance and about three standard errors below the measurements.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from configs import horizon
from tests.helpers import child_xla_flags, subprocess_env
from training import shapes, shapes_vqa
from training.tokenizer import default_tokenizer_path, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
GOOD = dict(steps=3, batch=4, learning_rate=1e-3, warmup_steps=1, seq_len=0, eval_examples=8,
            question_types=["colour", "count"], log_every=1)


@pytest.fixture
def no_training(monkeypatch):
  """Makes training fail the test (the checks must come first); returns the TrainConfigs it got."""
  got = []

  def train_vqa(config, tokenizer, tc, *args, **kwargs):
    got.append(tc)
    raise AssertionError("training started")
  monkeypatch.setattr(shapes_vqa, "train_vqa", train_vqa)
  return got


@pytest.mark.parametrize("overrides, words", [
    (dict(steps=0), "--steps=0: must be a positive int"),
    (dict(batch=0), "--batch=0: must be a positive int"),
    (dict(learning_rate=-1.0), "--learning_rate=-1.0: must be a finite number > 0"),
    (dict(learning_rate=0.0), "--learning_rate=0.0: must be a finite number > 0"),
    (dict(learning_rate=math.nan), "--learning_rate=nan: must be a finite number > 0"),
    (dict(warmup_steps=-5), "--warmup_steps=-5: must be an int >= 0"),
    (dict(seq_len=-1), "--seq_len=-1: must be an int >= 0"),
    (dict(seq_len=8), "--seq_len=8: too short for the longest colour,count example"),
    (dict(seq_len=257), "--seq_len=257: 257 tokens exceed config.model.max_seq_len=256"),  # trained on
    (dict(eval_examples=0), "--eval_examples=0: must be an int >= 2"),
    (dict(eval_examples=-3), "--eval_examples=-3: must be an int >= 2"),
    (dict(eval_examples=3, question_types=list(shapes.QUESTION_TYPES)),
     "--eval_examples=3: must be an int >= 4"),
    (dict(log_every=0), "--log_every=0: must be a positive int"),
    (dict(question_types=[]), "--question_types is empty: give one or more of colour, shape"),
    (dict(question_types=["colour", "size"]),
     "--question_types=colour,size: unknown question type(s) ['size']"),
    (dict(learning_rate=True), "--learning_rate=True: must be a finite number > 0"),
    (dict(seed=2 ** 31), "config.seed=2147483648: must be an int in [0, 2^31)"),
    (dict(batch=3, **{"train.grad_accum": 2}), "--batch=3: must be divisible by config.train.grad_accum=2"),
    ({"train.weight_decay": -1.0}, "config.train.weight_decay=-1.0: must be >= 0"),
    ({"seed": -1}, "config.seed=-1: must be an int in [0, 2^31)"),
])
def test_bad_arguments_are_refused_before_training(no_training, overrides, words):
  config = horizon.get_config("tiny")
  args = dict(GOOD)
  for k, v in overrides.items():  # "train.x" and "seed": config fields; the rest: run's arguments
    if k.startswith("train."):
      config.train[k.removeprefix("train.")] = v
    elif k == "seed":
      config.seed = v
    else:
      args[k] = v
  with pytest.raises(shapes_vqa.RunArgsError) as e:
    shapes_vqa.run(config, **args)
  assert words in str(e.value)
  assert not no_training


def test_arguments_set_config_train_through_its_checks(no_training):
  config = horizon.get_config("tiny")
  config.train.grad_accum = 2
  with pytest.raises(AssertionError, match="training started"):
    shapes_vqa.run(config, **GOOD)
  tok = load_tokenizer(default_tokenizer_path("tiny"))
  cfg_model = shapes_vqa.model_config(config)
  (tc,) = no_training
  assert (tc.steps, tc.global_batch, tc.learning_rate, tc.warmup_steps) == (3, 4, 1e-3, 1)
  assert tc.seq_len == shapes_vqa.vqa_seq_len(tok, cfg_model)
  assert tc.grad_accum == 2 and tc.weight_decay == config.train.weight_decay  # the rest: config.train
  # The shortest seq_len that holds every row is accepted; one less is refused above.
  shortest = shapes_vqa.min_seq_len(tok, cfg_model, GOOD["question_types"])
  with pytest.raises(AssertionError, match="training started"):
    shapes_vqa.run(config, **(GOOD | {"seq_len": shortest}))
  with pytest.raises(shapes_vqa.RunArgsError, match=f"give >= {shortest}"):
    shapes_vqa.run(config, **(GOOD | {"seq_len": shortest - 1}))


def test_train_vqa_checks_log_every_and_question_types_before_building_the_model(monkeypatch):
  monkeypatch.setattr(shapes_vqa, "Horizon", lambda *a, **k: pytest.fail("model built"))
  config = horizon.get_config("tiny")
  with pytest.raises(shapes_vqa.RunArgsError, match="--log_every=0"):
    shapes_vqa.train_vqa(config, None, None, ["colour"], 0)
  with pytest.raises(shapes_vqa.RunArgsError, match="--question_types is empty"):
    shapes_vqa.train_vqa(config, None, None, [], 1)


def test_config_train_overrides_that_a_flag_replaces_are_refused():
  shapes_vqa.check_train_overrides({"train.grad_accum": 2, "model.dtype": "float32", "seed": 1})
  for field, flag in shapes_vqa.ARG_FIELDS.items():
    with pytest.raises(shapes_vqa.RunArgsError, match=f"--config.train.{field}=2: .* pass --{flag}=2"):
      shapes_vqa.check_train_overrides({f"train.{field}": 2})


def test_shapes_refuses_empty_question_types_and_no_examples():
  tok = load_tokenizer(default_tokenizer_path("tiny"))
  cfg_model = shapes_vqa.model_config(horizon.get_config("tiny"))
  rng = shapes.split_rng("train", 0)
  with pytest.raises(ValueError, match="question_types is empty"):  # it used to mean all types
    shapes.shapes_batch(rng, 2, tok, cfg_model, 64, question_types=[])
  with pytest.raises(ValueError, match="batch=0"):
    shapes.shapes_batch(rng, 0, tok, cfg_model, 64)
  with pytest.raises(ValueError, match="question_types is empty"):
    shapes.heldout_examples(4, 16, question_types=())
  with pytest.raises(ValueError, match="n=0: must be a positive int"):
    shapes.heldout_examples(0, 16)
  with pytest.raises(ValueError, match=r"question_types='colour': give a list"):
    shapes.heldout_examples(4, 16, question_types="colour")
  assert [e[3]["question_type"] for e in shapes.heldout_examples(4, 16)] == list(shapes.QUESTION_TYPES)


def test_command_line_refusals_name_the_flag():
  """A --config.train.X a flag would replace, a stray argument, a bad value: refused before training."""
  base = [sys.executable, "-m", "experiments.shapes_vqa", "--config=configs/horizon.py:tiny"]
  for extra, words in [(["--config.train.steps=2"], "--config.train.steps=2: shapes_vqa sets"),
                       (["false"], "unexpected arguments ['false']"),
                       (["--learning_rate=-1"], "--learning_rate=-1.0: must be a finite number > 0")]:
    proc = subprocess.run(base + extra, cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and words in proc.stderr, (extra, proc.stderr[-2000:])
    assert "answer CE" not in proc.stdout, proc.stdout


@pytest.mark.slow
def test_tiny_answers_colour_questions_above_chance():
  env = dict(os.environ, XLA_FLAGS=child_xla_flags(1))  # one CPU device
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.shapes_vqa", "--config=configs/horizon.py:tiny",
       "--eval_examples=400"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
  assert proc.returncode == 0, proc.stderr[-3000:]
  print(proc.stdout)
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert result["colour_chance"] == pytest.approx(1 / 6)
  assert result["colour_accuracy"] >= 0.35, result
  assert result["count_accuracy"] >= 0.6, result  # count is learned first (measured 0.94-1.0)


@pytest.mark.parametrize("overrides", [dict(warmup_steps=0), dict(eval_examples=2), dict(seq_len=200)])
def test_boundary_arguments_are_accepted_and_kept(no_training, overrides):
  """warmup 0, one held-out example per type and an explicit seq_len are valid (mutants refused the
  first two and replaced the third with the default)."""
  with pytest.raises(AssertionError, match="training started"):
    shapes_vqa.run(horizon.get_config("tiny"), **(GOOD | overrides))
  (tc,) = no_training
  assert tc.warmup_steps == overrides.get("warmup_steps", 1)
  if "seq_len" in overrides:
    assert tc.seq_len == 200
