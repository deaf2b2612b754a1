"""The shapes VQA run: train the model on procedural image questions, then answer held-out ones.

Trains with the pretraining step (`training.train_step`: AdamW, warm-up +
cosine, router/indexer auxiliary losses) on image + question + answer rows of
`training.shapes` (loss on the answer only), then answers held-out questions
greedily through prefill + decode_step and exact-matches the answer strings
(`shapes.evaluate_vqa`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.config import model_config
from model.decoder import Horizon
from training import shapes
from training.tokenizer import default_tokenizer_path, load_tokenizer
from training.train_step import TrainConfig, jit_train_step, make_train_state


def vqa_seq_len(tokenizer, cfg) -> int:
  """Longest possible row (longest question + longest answer + eos), rounded up to 16."""
  qs = [f"What colour is the {s}?" for s in shapes.SHAPES] + [f"What shape is {c}?" for c in shapes.COLOURS]
  qs += [f"Where is the {c} {s}?" for c in shapes.COLOURS for s in shapes.SHAPES] + ["How many shapes?"]
  answers = (*shapes.COLOURS, *shapes.SHAPES, *shapes.COUNTS, *shapes.CELLS)
  longest = (cfg.vision.num_patches + max(len(tokenizer.encode(q)) for q in qs)
             + max(len(tokenizer.encode(" " + a)) for a in answers))
  return -(-longest // 16) * 16


def train_vqa(config, tokenizer, tc: TrainConfig, question_types: Sequence[str], log_every: int,
              log: Callable[[str], None] = print) -> tuple[Horizon, list[float]]:
  """tc.steps steps of tc.global_batch shapes rows; returns the model and the answer CE per step.

  Raises:
    FloatingPointError: the answer cross-entropy became non-finite.
  """
  cfg = model_config(config)
  model = Horizon(cfg, rngs=nnx.Rngs(config.seed))
  optimizer = make_train_state(model, tc)
  rng = shapes.split_rng("train", config.seed)
  losses = []
  t0 = time.perf_counter()
  for step in range(tc.steps):
    rows = shapes.shapes_batch(rng, tc.global_batch, tokenizer, cfg, tc.seq_len, question_types)
    metrics = jit_train_step(model, optimizer, {k: jnp.asarray(v) for k, v in rows.items()}, tc)
    losses.append(float(metrics["ce"]))
    if not np.isfinite(losses[-1]):
      raise FloatingPointError(f"step {step}: answer cross-entropy is {losses[-1]}; stopping.")
    if step % log_every == 0 or step == tc.steps - 1:
      log(f"step {step:4d}  answer CE {losses[-1]:.4f}  ({time.perf_counter() - t0:.0f}s)")
  return model, losses


def run(config, *, steps: int, batch: int, learning_rate: float, warmup_steps: int, seq_len: int,
        eval_examples: int, question_types: Sequence[str], log_every: int,
        log: Callable[[str], None] = print) -> dict:
  """Trains (config.train with the given overrides; seq_len 0 = `vqa_seq_len`) and evaluates.

  Returns:
    {"per_type": shapes.evaluate_vqa's {type: {accuracy, chance, present_guess, n}},
     "train_seconds", "final_answer_ce", "devices"}.
  """
  cfg = model_config(config)
  tokenizer = load_tokenizer(default_tokenizer_path(config.variant), model_vocab_size=cfg.vocab_size,
                             image_token_id=cfg.image_token_id)
  tc = dataclasses.replace(TrainConfig.from_config(config.train), steps=steps, global_batch=batch,
                           seq_len=seq_len or vqa_seq_len(tokenizer, cfg), learning_rate=learning_rate,
                           warmup_steps=warmup_steps)
  t0 = time.perf_counter()
  model, losses = train_vqa(config, tokenizer, tc, question_types, log_every, log)
  train_s = time.perf_counter() - t0
  per_type = shapes.evaluate_vqa(model, tokenizer, cfg, eval_examples, question_types=question_types)
  return {"per_type": per_type, "train_seconds": round(train_s, 1), "final_answer_ce": losses[-1],
          "devices": jax.device_count()}
