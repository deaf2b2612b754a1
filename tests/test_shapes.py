"""training/shapes.py: determinism, answers re-derived from pixels, batch layout and loss mask."""

import numpy as np
import pytest

from training import batch_checks, shapes
from training.tokenizer import default_tokenizer_path, load_tokenizer


@pytest.fixture(scope="module")
def tok():
  return load_tokenizer(default_tokenizer_path("tiny"))


def test_same_seed_same_example_and_splits_differ():
  a = shapes.make_example(shapes.split_rng("train", 5), 16)
  b = shapes.make_example(shapes.split_rng("train", 5), 16)
  c = shapes.make_example(shapes.split_rng("heldout", 5), 16)
  assert np.array_equal(a[0], b[0]) and a[1:3] == b[1:3]
  assert not np.array_equal(a[0], c[0])
  assert a[0].dtype == np.float32 and a[0].shape == (16, 16, 3) and 0 <= a[0].min() <= a[0].max() <= 1
  with pytest.raises(ValueError, match="seed=-1"):
    shapes.split_rng("train", -1)
  with pytest.raises(ValueError, match="question_type='size'"):
    shapes.make_example(shapes.split_rng("train", 0), 16, "size")


def _objects(image):
  """Re-derives the objects from pixels: {colour: boolean mask} of non-background pixels."""
  names = list(shapes.COLOURS)
  palette = np.asarray([shapes.COLOURS[n] for n in names] + [(shapes.BACKGROUND,) * 3])
  nearest = np.argmin(((image[:, :, None, :] - palette) ** 2).sum(-1), axis=-1)
  return {names[i]: nearest == i for i in range(len(names)) if (nearest == i).any()}


def _kind(mask):
  """circle / square / triangle from how much of its bounding box the shape fills."""
  ys, xs = np.nonzero(mask)
  fill = mask.sum() / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
  return "square" if fill > 0.9 else "circle" if fill > 0.66 else "triangle"


def _cell(mask):
  ys, xs = np.nonzero(mask)
  h = mask.shape[0] / 2
  return shapes.CELLS[2 * int(ys.mean() >= h) + int(xs.mean() >= h)]


@pytest.mark.parametrize("qtype", shapes.QUESTION_TYPES)
def test_answers_match_the_pixels(qtype):
  rng = shapes.split_rng("train", 123)
  for _ in range(40):
    image, question, answer, meta = shapes.make_example(rng, 64, qtype)
    objs = _objects(image)
    assert sorted(objs) == sorted(s["colour"] for s in meta["shapes"])
    by_kind = {_kind(m): c for c, m in objs.items()}
    assert len(by_kind) == len(objs)  # kinds are distinct and recognisable
    target = meta["shapes"][meta["target"]]
    cy, cx = (int(v) for v in target["center"])
    assert shapes.nearest_colour(image[cy, cx]) == target["colour"]
    if qtype == "colour":
      kind = question.removeprefix("What colour is the ").removesuffix("?")
      assert answer == by_kind[kind]
    elif qtype == "shape":
      colour = question.removeprefix("What shape is ").removesuffix("?")
      assert answer == _kind(objs[colour])
    elif qtype == "count":
      assert answer == shapes.COUNTS[len(objs) - 1]
    else:
      colour = question.removeprefix("Where is the ").split()[0]
      assert answer == _cell(objs[colour])


def test_batch_layout_and_mask_covers_exactly_the_answer(tok, tiny_cfg):
  b, seq = 6, 64
  batch = shapes.shapes_batch(shapes.split_rng("train", 9), b, tok, tiny_cfg, seq)
  v = tiny_cfg.vision
  assert batch["images"].shape == (b, 1, v.image_size, v.image_size, 3)
  batch_checks.check_batch({k: batch[k] for k in batch_checks.LM_KEYS if k != "loss_mask"} |
                   {"loss_mask": (batch["segment_ids"] > 0).astype(np.float32)}, tok.eos_id)
  for r in range(b):
    n = int((batch["segment_ids"][r] > 0).sum())
    inputs, targets, mask = batch["inputs"][r, :n], batch["targets"][r, :n], batch["loss_mask"][r]
    first = int(np.argmax(mask))  # the last prompt token: its target is the answer's first
    assert mask[first:n].all() and not mask[:first].any() and not mask[n:].any()
    assert np.all(inputs[first + 1 - v.num_patches:first + 1] == tok.image_id)
    assert np.sum(inputs == tok.image_id) == v.num_patches and targets[-1] == tok.eos_id
    question = tok.decode(inputs[:first + 1 - v.num_patches])
    answer = tok.decode(targets[first:n - 1])
    assert answer.startswith(" ")
    answer = answer[1:]
    valid = {"What colour": shapes.COLOURS, "What shape": shapes.SHAPES, "How many": shapes.COUNTS,
             "Where is": shapes.CELLS}
    assert any(question.startswith(q) and answer in opts for q, opts in valid.items()), (question, answer)
  with pytest.raises(ValueError, match="raise seq_len"):
    shapes.shapes_batch(shapes.split_rng("train", 9), 2, tok, tiny_cfg, 20)


def test_greedy_generation_matches_the_full_forward(tok, tiny_cfg):
  """prefill + decode_step with an image equals re-running the whole (causal) sequence each step."""
  import jax.numpy as jnp
  from flax import nnx

  from model.decoder import build_model

  model = build_model(tiny_cfg, seed=3)
  rng = shapes.split_rng("heldout", 1)
  exs = [shapes.make_example(rng, tiny_cfg.vision.image_size, q) for q in ("colour", "position")]
  prompts = [shapes.encode_example(q, a, tok, tiny_cfg.vision.num_patches)[0] for _, q, a, _ in exs]
  assert len(prompts[0]) != len(prompts[1])  # right padding is exercised
  images = np.stack([e[0] for e in exs])[:, None]
  got = shapes.greedy_generate(model, prompts, images, 3, tok.pad_id)
  # Reference: one fixed-width buffer (one compile); causal, so right padding is invisible.
  forward = nnx.jit(lambda m, t, im: m(t, images=im)[0])
  seqs = [list(p) for p in prompts]
  for _ in range(3):
    buf = np.full((2, max(map(len, prompts)) + 3), tok.pad_id, np.int32)
    for r, s in enumerate(seqs):
      buf[r, :len(s)] = s
    logits = np.asarray(forward(model, jnp.asarray(buf), jnp.asarray(images)))
    for r, s in enumerate(seqs):
      s.append(int(np.argmax(logits[r, len(s) - 1])))
  assert [s[len(p):] for s, p in zip(seqs, prompts, strict=True)] == got.tolist()
  answers = shapes.answer_questions(model, tok, tiny_cfg, images[:, 0], [e[1] for e in exs], max_new=3)
  assert len(answers) == 2 and all(isinstance(a, str) for a in answers)
