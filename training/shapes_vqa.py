"""The shapes VQA run: train the model on procedural image questions, then answer held-out ones.

Trains with the pretraining step (`training.train_step`: AdamW, warm-up +
cosine, router/indexer auxiliary losses) on image + question + answer rows of
`training.shapes` (loss on the answer only), then answers held-out questions
greedily through prefill + decode_step and exact-matches the answer strings
(`shapes.evaluate_vqa`).

`run` checks its arguments (named as experiments/shapes_vqa.py's flags of the
same names) and config before it builds the model: a bad one is a
`RunArgsError` naming the flag or field and the fix. Its steps, batch, seq_len,
learning_rate and warmup_steps set config.train's steps, global_batch, seq_len,
learning_rate and warmup_steps (`ARG_FIELDS`) and pass TrainConfig's checks with
the rest of config.train; `check_train_overrides` refuses a `--config.train.X`
override that one of them would replace.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.config import is_int, model_config
from model.decoder import Horizon
from training import shapes
from training.tokenizer import default_tokenizer_path, load_tokenizer
from training.train_step import TrainConfig, jit_train_step, make_train_state

# config.train fields that `run` sets from its arguments (experiments/shapes_vqa.py's flags).
ARG_FIELDS = {"steps": "steps", "global_batch": "batch", "seq_len": "seq_len",
              "learning_rate": "learning_rate", "warmup_steps": "warmup_steps"}
_QUESTIONS = {  # every question make_example can ask, per type
    "colour": [f"What colour is the {s}?" for s in shapes.SHAPES],
    "shape": [f"What shape is {c}?" for c in shapes.COLOURS],
    "count": ["How many shapes?"],
    "position": [f"Where is the {c} {s}?" for c in shapes.COLOURS for s in shapes.SHAPES]}
_ANSWERS = {"colour": tuple(shapes.COLOURS), "shape": shapes.SHAPES, "count": shapes.COUNTS,
            "position": shapes.CELLS}


class RunArgsError(ValueError):
  """A bad argument of `run` (named as its flag) or config field, found before the model is built."""


def vqa_seq_len(tokenizer, cfg) -> int:
  """Longest possible row (longest question + longest answer + eos), rounded up to 16."""
  qs = [q for t in shapes.QUESTION_TYPES for q in _QUESTIONS[t]]
  answers = [a for t in shapes.QUESTION_TYPES for a in _ANSWERS[t]]
  longest = (cfg.vision.num_patches + max(len(tokenizer.encode(q)) for q in qs)
             + max(len(tokenizer.encode(" " + a)) for a in answers))
  return -(-longest // 16) * 16


def min_seq_len(tokenizer, cfg, question_types: Sequence[str]) -> int:
  """The shortest seq_len that holds every row of these question types (its next-token pairs)."""
  return cfg.vision.num_patches + max(
      max(len(tokenizer.encode(q)) for q in _QUESTIONS[t])
      + max(len(tokenizer.encode(" " + a)) for a in _ANSWERS[t]) for t in question_types)


def _require(name: str, value: Any, ok: bool, rule: str) -> None:
  if not ok:
    raise RunArgsError(f"--{name}={value!r}: must be {rule}.")


def check_train_overrides(overrides: Mapping[str, Any]) -> None:
  """Refuses `--config.train.X` overrides ({"train.steps": 2, ...}, as ml_collections'
  config_flags.get_override_values gives them) of the fields that `run`'s arguments set: the
  override would be replaced silently by the flag's value."""
  for key, value in overrides.items():
    field = key.removeprefix("train.")
    if key.startswith("train.") and field in ARG_FIELDS:
      flag = ARG_FIELDS[field]
      raise RunArgsError(f"--config.train.{field}={value!r}: shapes_vqa sets config.train.{field} from "
                         f"--{flag}, which would replace it; pass --{flag}={value} instead.")


def check_args(*, steps: int, batch: int, learning_rate: float, warmup_steps: int, seq_len: int,
               eval_examples: int, question_types: Sequence[str], log_every: int) -> tuple[str, ...]:
  """Checks `run`'s arguments, naming the flag; returns the question types as a tuple.

  Raises:
    RunArgsError: a bad argument.
  """
  _require("steps", steps, is_int(steps) and steps >= 1, "a positive int (optimizer steps)")
  _require("batch", batch, is_int(batch) and batch >= 1, "a positive int (examples per step)")
  lr_ok = isinstance(learning_rate, (int, float)) and not isinstance(learning_rate, bool)
  _require("learning_rate", learning_rate, lr_ok and 0 < learning_rate < math.inf,
           "a finite number > 0 (the peak rate)")
  _require("warmup_steps", warmup_steps, is_int(warmup_steps) and warmup_steps >= 0, "an int >= 0")
  _require("seq_len", seq_len, is_int(seq_len) and seq_len >= 0,
           "an int >= 0 (0: the longest example rounded up to 16)")
  _require("log_every", log_every, is_int(log_every) and log_every >= 1, "a positive int")
  try:
    types = shapes.check_question_types(question_types, "--question_types")
  except ValueError as e:
    raise RunArgsError(str(e)) from None
  _require("eval_examples", eval_examples, is_int(eval_examples) and eval_examples >= len(types),
           f"an int >= {len(types)}, the number of question types (held-out examples are split "
           "evenly over them, so each type is evaluated)")
  return types


def train_config(config, tokenizer, cfg, *, steps: int, batch: int, learning_rate: float,
                 warmup_steps: int, seq_len: int, question_types: Sequence[str]) -> TrainConfig:
  """config.train with the arguments' fields (`ARG_FIELDS`; seq_len 0 = `vqa_seq_len`), checked.

  Raises:
    RunArgsError: a row of these question types does not fit seq_len, seq_len exceeds the model's
      max_seq_len, batch does not divide into config.train.grad_accum micro-batches, or
      config.train fails TrainConfig's checks.
  """
  shortest = min_seq_len(tokenizer, cfg, question_types)
  if seq_len and seq_len < shortest:
    raise RunArgsError(f"--seq_len={seq_len}: too short for the longest {','.join(question_types)} "
                       f"example ({shortest} next-token pairs); give >= {shortest}, or 0 for "
                       f"{vqa_seq_len(tokenizer, cfg)}.")
  length = seq_len or vqa_seq_len(tokenizer, cfg)
  if length > cfg.max_seq_len:  # positions past the model's (pretraining refuses it: training.loop)
    raise RunArgsError(f"--seq_len={seq_len}{' (the default)' if not seq_len else ''}: {length} tokens "
                       f"exceed config.model.max_seq_len={cfg.max_seq_len}; lower --seq_len or raise "
                       "--config.model.max_seq_len.")
  train = dict(config.train.items())
  accum = train.get("grad_accum")
  if is_int(accum) and accum >= 1 and batch % accum:
    raise RunArgsError(f"--batch={batch}: must be divisible by config.train.grad_accum={accum} "
                       "(micro-batches per step); change --batch or --config.train.grad_accum.")
  train.update(steps=steps, global_batch=batch, seq_len=length,
               learning_rate=learning_rate, warmup_steps=warmup_steps)
  try:
    return TrainConfig.from_config(train)
  except ValueError as e:  # the arguments' fields passed above, so a config.train field is named
    raise RunArgsError(str(e)) from None


def train_vqa(config, tokenizer, tc: TrainConfig, question_types: Sequence[str], log_every: int,
              log: Callable[[str], None] = print) -> tuple[Horizon, list[float]]:
  """tc.steps steps of tc.global_batch shapes rows; returns the model and the answer CE per step.

  Raises:
    RunArgsError: log_every < 1 or bad question_types (before the model is built).
    FloatingPointError: the answer cross-entropy became non-finite.
  """
  _require("log_every", log_every, is_int(log_every) and log_every >= 1, "a positive int")
  try:
    question_types = shapes.check_question_types(question_types, "--question_types")
  except ValueError as e:
    raise RunArgsError(str(e)) from None
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
  """Checks everything, then trains (`train_config`) and evaluates.

  The arguments are experiments/shapes_vqa.py's flags of the same names; they replace
  config.train's `ARG_FIELDS` (seq_len 0 = `vqa_seq_len`).

  Raises:
    RunArgsError: a bad argument (named as its flag), config.seed, config.train field or a model
      config without vision, before the model is built.

  Returns:
    {"per_type": shapes.evaluate_vqa's {type: {accuracy, chance, present_guess, n}},
     "train_seconds", "final_answer_ce", "devices"}.
  """
  types = check_args(steps=steps, batch=batch, learning_rate=learning_rate, warmup_steps=warmup_steps,
                     seq_len=seq_len, eval_examples=eval_examples, question_types=question_types,
                     log_every=log_every)
  seed = config.get("seed")
  if not is_int(seed) or not 0 <= seed < 1 << 31:
    raise RunArgsError(f"config.seed={seed!r}: must be an int in [0, 2^31) (it picks the training and "
                       "held-out example streams).")
  cfg = model_config(config)
  tokenizer = load_tokenizer(default_tokenizer_path(config.variant), model_vocab_size=cfg.vocab_size,
                             image_token_id=cfg.image_token_id)
  try:
    shapes.check_model(tokenizer, cfg)
  except ValueError as e:
    raise RunArgsError(str(e)) from None
  tc = train_config(config, tokenizer, cfg, steps=steps, batch=batch, learning_rate=learning_rate,
                    warmup_steps=warmup_steps, seq_len=seq_len, question_types=types)
  t0 = time.perf_counter()
  model, losses = train_vqa(config, tokenizer, tc, types, log_every, log)
  train_s = time.perf_counter() - t0
  per_type = shapes.evaluate_vqa(model, tokenizer, cfg, eval_examples, question_types=types)
  return {"per_type": per_type, "train_seconds": round(train_s, 1), "final_answer_ce": losses[-1],
          "devices": jax.device_count()}
