"""training/shapes.py edge cases that a mutation audit found unpinned: the split's seed ranges, the
held-out stream, how many shapes and which one a question asks about, the question types a batch
draws, the model checks, and the seq_len boundary of a row."""

import dataclasses

import numpy as np
import pytest

from training import shapes
from training.tokenizer import default_tokenizer_path, load_tokenizer


@pytest.fixture(scope="module")
def tok():
  return load_tokenizer(default_tokenizer_path("tiny"))


def test_split_seeds_are_offsets_into_disjoint_ranges():
  """train seed s is numpy's seed s, held-out seed s is 2^31 + s (a mutant used 2^30: held-out seed
  2^30 + s was then train seed s... inside the train range); the last seed is 2^31 - 1."""
  for split, base in (("train", 0), ("heldout", 2 ** 31)):
    for seed in (0, 7, 2 ** 31 - 1):
      got = shapes.split_rng(split, seed).integers(0, 2 ** 62, 4)
      np.testing.assert_array_equal(got, np.random.default_rng(base + seed).integers(0, 2 ** 62, 4))
  with pytest.raises(ValueError, match=r"seed=2147483648: must be an int in \[0, 2\^31\)"):
    shapes.split_rng("heldout", 2 ** 31)


def test_heldout_examples_come_from_the_heldout_stream():
  """A mutant evaluated on the training stream (seed s of 'train'), i.e. on examples trained on."""
  got = shapes.heldout_examples(2, 16, seed=3)
  rng = np.random.default_rng(2 ** 31 + 3)
  for (image, question, answer, _), qtype in zip(got, ("colour", "shape"), strict=True):
    want = shapes.make_example(rng, 16, qtype)
    np.testing.assert_array_equal(image, want[0])
    assert (question, answer) == want[1:3]


def test_every_shape_count_and_every_target_occur():
  """1-3 shapes (max_shapes=3 by default), and a question about any of them: mutants never drew three
  shapes, defaulted max_shapes to 2, or never asked about the last shape drawn."""
  rng = shapes.split_rng("train", 11)
  seen = set()
  for _ in range(300):
    _, _, _, meta = shapes.make_example(rng, 16, "colour")
    seen.add((len(meta["shapes"]), meta["target"]))
  assert seen == {(1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2)}
  counts = {len(shapes.make_example(rng, 16, "count", max_shapes=1)[3]["shapes"]) for _ in range(20)}
  assert counts == {1}
  with pytest.raises(ValueError, match=r"max_shapes=0: must be in \[1, 3\]"):
    shapes.make_example(rng, 16, max_shapes=0)


def test_a_batch_draws_every_allowed_question_type(tok, tiny_cfg):
  """A mutant asked only the first type (colour) of every batch; a numpy int batch is a batch size (a
  mutant refused it)."""
  batch = shapes.shapes_batch(shapes.split_rng("train", 4), 40, tok, tiny_cfg, 64)
  starts = {"What colour": "colour", "What shape": "shape", "How many": "count", "Where is": "position"}
  got = set()
  for row in batch["inputs"]:
    text = tok.decode(row[:10].tolist())
    got |= {t for q, t in starts.items() if text.startswith(q)}
  assert got == set(shapes.QUESTION_TYPES)
  batch = shapes.shapes_batch(shapes.split_rng("train", 4), np.int64(12), tok, tiny_cfg, 64, ["count"])
  assert all(tok.decode(r[:10].tolist()).startswith("How many") for r in batch["inputs"])


def test_a_model_without_vision_or_with_another_image_id_is_refused(tok, tiny_cfg):
  rng = shapes.split_rng("train", 0)
  blind = tiny_cfg.replace(vision=dataclasses.replace(tiny_cfg.vision, enabled=False))
  with pytest.raises(ValueError, match=r"needs config.model.vision.enabled=True"):
    shapes.shapes_batch(rng, 2, tok, blind, 64)
  other = tiny_cfg.replace(image_token_id=tiny_cfg.image_token_id - 1)
  with pytest.raises(ValueError, match=rf"tokenizer <\|image\|> id {tok.image_id} != config"):
    shapes.shapes_batch(rng, 2, tok, other, 64)


def test_a_row_that_just_fits_is_packed_and_one_token_less_is_refused():
  """prompt [1, 2, 3] + answer [4, 5]: 4 next-token pairs, loss on the targets 4 and 5 (a mutant let
  seq_len 3 through to a numpy broadcast error)."""
  out = shapes.pack_rows([[1, 2, 3]], [[4, 5]], 4, pad_id=0)
  assert out["inputs"].tolist() == [[1, 2, 3, 4]] and out["targets"].tolist() == [[2, 3, 4, 5]]
  assert out["loss_mask"].tolist() == [[0, 0, 1, 1]] and out["positions"].tolist() == [[0, 1, 2, 3]]
  out = shapes.pack_rows([[1, 2, 3]], [[4, 5]], 6, pad_id=9)
  assert out["inputs"].tolist() == [[1, 2, 3, 4, 9, 9]]
  assert out["segment_ids"].tolist() == [[1, 1, 1, 1, 0, 0]]
  with pytest.raises(ValueError, match=r"seq_len=3 is too short .* 4 next-token pairs .* >= 4"):
    shapes.pack_rows([[1, 2, 3]], [[4, 5]], 3, pad_id=0)


def test_split_seed_must_be_an_int_and_answer_batch_positive(tok, tiny_cfg):
  """True read as seed 1 (the same images as seed 1, silently); a NumPy seed is that seed; a batch
  of 0 was a bare range() error after loading the model."""
  np.testing.assert_array_equal(shapes.split_rng("train", np.int64(7)).integers(0, 2 ** 62, 3),
                                np.random.default_rng(7).integers(0, 2 ** 62, 3))
  for bad in (True, 1.0, "1"):
    with pytest.raises(ValueError, match=r"seed=.*: must be an int in \[0, 2\^31\)"):
      shapes.split_rng("train", bad)
  with pytest.raises(ValueError, match=r"answer_questions: batch=0 must be a positive int"):
    shapes.answer_questions(None, tok, tiny_cfg, np.zeros((1, 16, 16, 3), np.uint8), ["q"], batch=0)
