"""training/shapes_vqa.py and shapes' evaluation, edge cases a mutation audit found unpinned: the
seq_len bounds against every possible row, argument boundaries, the training stream, and how answers
are read and scored. The model and its training are stubbed: no compile."""

import itertools

import numpy as np
import pytest

from configs import horizon
from tests.test_shapes_vqa import GOOD
from training import shapes, shapes_vqa
from training.tokenizer import default_tokenizer_path, load_tokenizer

COLOURS = ("red", "green", "blue", "yellow", "purple", "cyan")
KINDS = ("circle", "square", "triangle")
ROWS = {  # every (question, answer) make_example can produce, written out from its docstring
    "colour": [(f"What colour is the {k}?", c) for k in KINDS for c in COLOURS],
    "shape": [(f"What shape is {c}?", k) for c in COLOURS for k in KINDS],
    "count": [("How many shapes?", n) for n in ("one", "two", "three")],
    "position": [(f"Where is the {c} {k}?", p) for c, k, p in itertools.product(
        COLOURS, KINDS, ("top left", "top right", "bottom left", "bottom right"))]}


@pytest.fixture(scope="module")
def tok():
  return load_tokenizer(default_tokenizer_path("tiny"))


def _pairs(tok, num_patches, question, answer):
  """Next-token pairs of a row: question + patches + " answer" + eos, less one."""
  return len(tok.encode(question)) + num_patches + len(tok.encode(" " + answer)) + 1 - 1


def test_seq_len_bounds_hold_the_longest_row_of_the_types(tok, tiny_cfg):
  """Mutants took every type's longest row, dropped the answer's leading space, shortened the
  position questions, or rounded vqa_seq_len down."""
  p = tiny_cfg.vision.num_patches
  longest = {t: max(_pairs(tok, p, q, a) for q, a in rows) for t, rows in ROWS.items()}
  assert longest["count"] < longest["position"]
  for types in (["count"], ["colour"], ["shape", "count"], ["position"], list(ROWS)):
    assert shapes_vqa.min_seq_len(tok, tiny_cfg, types) == max(longest[t] for t in types), types
  top = max(longest.values())
  assert shapes_vqa.vqa_seq_len(tok, tiny_cfg) == 16 * ((top + 15) // 16) >= top


def test_training_reads_the_train_stream_and_evaluation_the_chosen_types(monkeypatch):
  """The batches come from split_rng('train', config.seed) (a mutant trained on the held-out stream)
  and run() evaluates only the chosen question types (a mutant evaluated all four)."""
  config = horizon.get_config("tiny")
  config.seed = 21
  draws, evaluated = [], []

  def batch(rng, b, tokenizer, cfg, seq_len, question_types):
    draws.append((int(rng.integers(2 ** 62)), b, seq_len, tuple(question_types)))
    return {"inputs": np.zeros((b, seq_len), np.int32)}
  monkeypatch.setattr(shapes, "shapes_batch", batch)
  monkeypatch.setattr(shapes_vqa, "Horizon", lambda cfg, rngs: "model")
  monkeypatch.setattr(shapes_vqa, "make_train_state", lambda model, tc: "opt")
  ces = iter([2.0, 1.5, 1.25])
  monkeypatch.setattr(shapes_vqa, "jit_train_step", lambda m, o, rows, tc: {"ce": next(ces)})
  monkeypatch.setattr(shapes, "evaluate_vqa", lambda model, tok, cfg, n, question_types: evaluated.append(
      (model, n, tuple(question_types))) or {"colour": {"accuracy": 0.5}})
  logs = []
  out = shapes_vqa.run(config, **(GOOD | {"log_every": 2, "seq_len": 96}), log=logs.append)
  want = np.random.default_rng(21)
  assert draws == [(int(want.integers(2 ** 62)), 4, 96, ("colour", "count")) for _ in range(3)]
  assert evaluated == [("model", 8, ("colour", "count"))]
  assert out["per_type"] == {"colour": {"accuracy": 0.5}} and out["final_answer_ce"] == 1.25
  assert [line.split()[1] for line in logs] == ["0", "2"]


def _stub_generate(tok, calls):
  """greedy_generate's stand-in: row r answers COLOURS[image value] then eos and junk; records the
  image values of each call."""
  def generate(model, prompts, images, max_new, pad_id):
    keys = [int(round(float(im[0, 0, 0, 0]))) for im in images]
    calls.append(keys)
    rows = [tok.encode(" " + COLOURS[k]) + [tok.eos_id] + tok.encode(" no") for k in keys]
    return np.asarray([(r + [pad_id] * max_new)[:max_new] for r in rows], np.int32)
  return generate


def test_answers_are_cut_at_eos_without_the_leading_space(monkeypatch, tok, tiny_cfg):
  """Each batch gets its own images (a mutant gave every batch the first batch's) and an answer is
  the text before eos less its leading space (a mutant kept the space: no answer matched)."""
  calls = []
  monkeypatch.setattr(shapes, "greedy_generate", _stub_generate(tok, calls))
  images = np.stack([np.full((8, 8, 3), k, np.float32) for k in (3, 0, 5, 1, 2)])
  got = shapes.answer_questions(None, tok, tiny_cfg, images, ["What colour is the circle?"] * 5, 12, 2)
  assert calls == [[3, 0], [5, 1], [2]]
  assert got == ["yellow", "red", "cyan", "green", "blue"]


def test_evaluate_scores_exact_matches_per_type(monkeypatch, tok, tiny_cfg):
  """8 held-out examples, two per type; the first of each type answered right, the second with a
  prefix of the right answer (a mutant scored substrings as hits). present_guess: the mean of
  1 / shapes present (colour, shape, position), chance for count (a mutant swapped them)."""
  examples = shapes.heldout_examples(8, tiny_cfg.vision.image_size, seed=0)
  answers = [e[2] if i < 4 else e[2][:2] for i, e in enumerate(examples)]
  monkeypatch.setattr(shapes, "answer_questions", lambda *a, **k: answers)
  got = shapes.evaluate_vqa(None, tok, tiny_cfg, 8, seed=0)
  assert sorted(got) == sorted(shapes.QUESTION_TYPES)
  for i, qtype in enumerate(shapes.QUESTION_TYPES):
    n_shapes = [len(examples[i][3]["shapes"]), len(examples[i + 4][3]["shapes"])]
    chance = {"colour": 1 / 6, "shape": 1 / 3, "count": 1 / 3, "position": 1 / 4}[qtype]
    guess = chance if qtype == "count" else (1 / n_shapes[0] + 1 / n_shapes[1]) / 2
    assert got[qtype] == pytest.approx({"accuracy": 0.5, "chance": chance, "present_guess": guess, "n": 2})
