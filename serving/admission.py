"""What the engine admits: a Request checked against the engine's limits before it is queued.

A request that fails here never takes a slot; the caller gets a
`RequestError` whose `param` names the field at fault (the servers turn it
into a 400 naming that field). The checks are what the engine relies on
later: every id is in the vocabulary, `len(prompt) + max_tokens` fits the
slot's `max_context` (under `jit` the model silently drops cache writes
beyond its length, so the engine must never get there), and the image
placeholders of the prompt match the images one to one.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from model.config import ConfigError, is_int
from serving.handle import Request, RequestError

TOP_K_MAX = 2**31 - 1  # the engine's top_k is int32 (serving/batch.py: sampling_args)


def validate_engine_args(model_cfg: Any, *, slots: int, max_context: int, prefill_chunk: int,
                         max_queue: int, decode_steps: int = 1) -> None:
  """The Engine's sizes, checked against each other and the model (ConfigError naming the field;
  model_cfg None: without the model's max_seq_len, as a launcher checks before loading it). NumPy
  ints pass (the Engine stores them as Python ints); bools do not."""
  for name, v in (("slots", slots), ("max_context", max_context), ("prefill_chunk", prefill_chunk),
                  ("max_queue", max_queue), ("decode_steps", decode_steps)):
    if not is_int(v, numpy=True) or v < 1:
      raise ConfigError(f"Engine: {name}={v!r} must be a positive int (config.serving.{name}).")
  if model_cfg is not None and max_context > model_cfg.max_seq_len:
    raise ConfigError(f"Engine: max_context={max_context} exceeds config.model.max_seq_len="
                      f"{model_cfg.max_seq_len}; lower config.serving.max_context.")
  if prefill_chunk > max_context:
    raise ConfigError(f"Engine: prefill_chunk={prefill_chunk} > max_context={max_context}; lower "
                      "config.serving.prefill_chunk.")


def check_prefix_settings(mb: Any, block: Any, prefill_chunk: int) -> None:
  """The prefix cache's settings (ConfigError naming the field); the block is checked only when
  the cache is on (mb > 0). NumPy numbers pass; bools do not."""
  if isinstance(mb, bool) or not isinstance(mb, numbers.Real) or not (mb >= 0 and math.isfinite(mb)):
    raise ConfigError(f"Engine: prefix_cache_mb={mb!r} must be a finite number >= 0 (0 = off; "
                      "config.serving.prefix_cache_mb).")
  if mb and mb * 2**20 < 1:  # the budget in whole bytes would be 0 (PrefixCache needs >= 1)
    raise ConfigError(f"Engine: prefix_cache_mb={mb!r} is under one byte; use 0 to turn the cache off "
                      "(config.serving.prefix_cache_mb).")
  if mb and (not is_int(block, numpy=True) or block < 1 or prefill_chunk % block):
    raise ConfigError(f"Engine: prefix_cache_block={block!r} must be a positive divisor of "
                      f"prefill_chunk={prefill_chunk} (config.serving.prefix_cache_block), so every "
                      "full prefill chunk ends on a block boundary.")


def validate_request(request: Request, *, max_context: int, vocab_size: int, model_cfg: Any,
                     has_vision: bool) -> None:
  """Raises RequestError for a request the engine cannot run as given.

  Args:
    request: the request.
    max_context: tokens per slot (prompt + generated).
    vocab_size: the model's vocabulary size.
    model_cfg: the served ModelConfig (image placeholder id, vision settings).
    has_vision: the model has a vision encoder.
  """
  ids, p = request.prompt_ids, request.params
  if len(ids) == 0:
    raise RequestError("the prompt is empty; give at least one token.", "prompt")
  if len(ids) > max_context:
    raise RequestError(f"the prompt has {len(ids)} tokens, more than the context of "
                       f"{max_context} tokens; shorten it.", "prompt")
  try:
    arr = np.asarray(ids)
  except ValueError:  # a ragged list
    arr = np.zeros((0, 0))
  if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0 or arr.max() >= vocab_size:
    raise RequestError(f"prompt ids must be ints in [0, {vocab_size}).", "prompt")
  if not is_int(p.max_tokens, numpy=True) or p.max_tokens < 1:
    raise RequestError(f"max_tokens={p.max_tokens!r} must be a positive int.", "max_tokens")
  if len(ids) + int(p.max_tokens) > max_context:  # int(): a numpy int's sum wraps around (np.int8(127) + 2)
    raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({p.max_tokens}) = "
                       f"{len(ids) + int(p.max_tokens)} exceeds the context of {max_context} "
                       f"tokens; lower max_tokens to at most {max_context - len(ids)}.", "max_tokens")
  _validate_sampling(p, vocab_size)
  _validate_images(arr, request.images, model_cfg, has_vision)


def _validate_sampling(p: Any, vocab_size: int) -> None:
  if (not isinstance(p.temperature, numbers.Real) or isinstance(p.temperature, (bool, np.bool_))
      or not np.isfinite(p.temperature) or p.temperature < 0):
    raise RequestError(f"temperature={p.temperature!r} must be a number >= 0 (0 = greedy).", "temperature")
  if not isinstance(p.top_p, numbers.Real) or isinstance(p.top_p, (bool, np.bool_)) or not 0 < p.top_p <= 1:
    raise RequestError(f"top_p={p.top_p!r} must be a number in (0, 1].", "top_p")
  if not is_int(p.top_k, numpy=True) or not 0 <= p.top_k <= TOP_K_MAX:
    raise RequestError(f"top_k={p.top_k!r} must be an int in [0, {TOP_K_MAX}] (0 = off).", "top_k")
  if p.seed is not None and not is_int(p.seed, numpy=True):
    raise RequestError(f"seed={p.seed!r} must be an int (or None).", "seed")
  stops = p.stop_token_ids
  if (not isinstance(stops, (Sequence, np.ndarray)) or isinstance(stops, (str, bytes))
      or any(not is_int(t, numpy=True) or not 0 <= t < vocab_size for t in stops)):
    raise RequestError(f"stop_token_ids must be a list of ids in [0, {vocab_size}); got {stops!r:.80}.",
                       "stop_token_ids")


def _validate_images(prompt: np.ndarray, images: np.ndarray | None, model_cfg: Any, has_vision: bool) -> None:
  """The images' shape, and exactly num_patches placeholder ids in the prompt per image."""
  n_ph = int(np.sum(prompt == model_cfg.image_token_id))
  m = 0 if images is None else len(images)
  if m and not has_vision:
    raise RequestError("this model has no vision encoder (config.model.vision.enabled is False).", "images")
  if m:
    v = model_cfg.vision
    want = (v.image_size, v.image_size, v.num_channels)
    if np.ndim(images) != 4 or tuple(np.shape(images)[1:]) != want:
      raise RequestError(f"images: expected [n, {want[0]}, {want[1]}, {want[2]}] float32 in [0, 1], "
                         f"got shape {list(np.shape(images))}; resize them first.", "images")
    arr = np.asarray(images)
    if arr.dtype.kind not in "fiu" or not np.all((arr >= 0) & (arr <= 1)):  # NaN fails both
      raise RequestError("images: pixel values must be numbers in [0, 1] (no NaN or inf); scale 8-bit "
                         "images by 1/255.", "images")
  per = model_cfg.vision.num_patches
  if n_ph != m * per:
    raise RequestError(f"the prompt has {n_ph} image placeholder tokens but {m} image(s) x {per} "
                       f"patches = {m * per} were given; each image needs exactly {per} "
                       "placeholders.", "images" if m else "prompt")
