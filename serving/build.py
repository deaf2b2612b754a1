"""Building an Engine from a serve config (configs/serve.py) and an optional checkpoint."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from serving.admission import check_prefix_settings, validate_engine_args
from serving.context import Limits
from serving.engine import Engine


def check_serve_config(config: Any) -> None:
  """`config.serving`'s engine sizes, prefix cache and request limits, checked before any weights
  load: a bad value stops a launcher with a ConfigError naming the field, not minutes later
  (the engine's max_context against the model's max_seq_len is checked once the model is known)."""
  s = config.serving
  validate_engine_args(None, slots=s.slots, max_context=s.max_context, prefill_chunk=s.prefill_chunk,
                       max_queue=s.max_queue, decode_steps=s.decode_steps)
  check_prefix_settings(s.prefix_cache_mb, s.prefix_cache_block, s.prefill_chunk)
  Limits.from_config(s)


def build_engine(config: Any, checkpoint: str | None = None, step: int | None = None,
                 model_overrides: Mapping[str, Any] | None = None) -> Engine:
  """An (unstarted) Engine from a serve config (configs/serve.py) and optional checkpoint.

  step: the checkpoint's step to load (default: its latest).

  With a checkpoint (written by the pretraining launcher), its stored model
  config wins over `config.model` (the weights decide the shapes), except for
  `model_overrides`: the config.model fields set on the command line
  (`experiments.config_util.model_overrides()`), applied where they are
  `model.config.RUNTIME_FIELDS` (dtype, kernels, ...) and refused where they
  contradict the weights. Without a checkpoint, the model is randomly
  initialised from `config.model` with seed 0.
  Tokenizer: `config.serving.tokenizer`, else the checkpoint run's
  `data.tokenizer`, else the bundled one of the variant.
  """
  from model.config import ModelConfig, with_runtime_overrides
  from model.decoder import build_model
  from training.checkpoint import load_model, read_meta, stored_model_config
  from training.tokenizer import default_tokenizer_path, load_tokenizer

  check_serve_config(config)
  s = config.serving
  run = {}
  if checkpoint:
    meta = read_meta(checkpoint, step)
    run = meta.get("config") or {}
    # Fields added since the checkpoint was written come from config.model. One step throughout, so
    # a trainer writing a newer checkpoint meanwhile cannot mix configs and weights.
    cfg = with_runtime_overrides(stored_model_config(checkpoint, config.model, meta["step"]),
                                 model_overrides, f"checkpoint {checkpoint} step {meta['step']}")
    model = load_model(checkpoint, cfg, step=meta["step"])
  else:
    cfg = ModelConfig.from_config(config.model)
    cfg.validate()
    model = build_model(cfg, seed=0)
  path = s.tokenizer or (run.get("data") or {}).get("tokenizer") or default_tokenizer_path(
      run.get("variant") or config.get("variant", "tiny"))
  field = ("--config.serving.tokenizer" if s.tokenizer else
           "--config.serving.tokenizer (this one is the checkpoint run's config.data.tokenizer)")
  tokenizer = load_tokenizer(path, model_vocab_size=cfg.vocab_size, image_token_id=cfg.image_token_id,
                             field=field)
  return Engine(model, tokenizer, slots=s.slots, max_context=s.max_context,
                prefill_chunk=s.prefill_chunk, seed=s.seed, max_queue=s.max_queue,
                prefix_cache_mb=s.prefix_cache_mb, prefix_cache_block=s.prefix_cache_block,
                prefix_cache_exact=s.prefix_cache_exact, decode_steps=s.decode_steps,
                batch_invariant=s.batch_invariant)
