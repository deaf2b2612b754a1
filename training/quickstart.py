"""The quickstart run: pretrain on the embedded corpus, reload the checkpoint, check decode, sample.

`run` trains with the one training loop (`training.loop.run`, the grain
pipeline over the Python standard library's source, tokenized with the
bundled BPE), reloads the last checkpoint the way the server does
(`training.checkpoint.load_model`), checks that prefill + step decode
reproduce the full forward pass, samples a continuation of a prompt, and
compares the final loss with the corpus's unigram entropy: the loss of the
best model that ignores context.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from array_record.python import array_record_module
from etils import epath

from model.config import ConfigError, is_int, model_config
from training import data as data_lib
from training import loop
from training.batches import tokenizer_for
from training.checkpoint import load_model


def unigram_entropy(prepared_dir: str, vocab_size: int) -> float:
  """Entropy (nats/token) of the prepared corpus's token frequencies."""
  manifest = data_lib.load_manifest(prepared_dir)
  counts = np.zeros(vocab_size, np.int64)
  for entry in manifest["sources"].values():
    for shard in entry["shards"]:
      reader = array_record_module.ArrayRecordReader(str(epath.Path(prepared_dir) / shard["file"]))
      for record in reader.read_all():
        counts += np.bincount(data_lib.decode_record(record), minlength=vocab_size)
      reader.close()
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


# Jitted once per process, so the sampler and both decode checks share compiled programs
# (a new jax.jit per call would compile each of them again).
_prefill = jax.jit(lambda m, x, k, c: m.prefill(x, k, c))
_step = jax.jit(lambda m, x, c: m.decode_step(x, c))
_forward = jax.jit(lambda m, x: m(x))


def sample(model, prompt_ids: list[int], new_tokens: int, temperature: float, seed: int) -> list[int]:
  """Prefill + decode with temperature sampling (greedy at temperature <= 0); the new token ids."""
  n = len(prompt_ids)
  cache = model.init_cache(1, n + new_tokens + 1)
  logits, cache = _prefill(model, jnp.asarray([prompt_ids], jnp.int32), jnp.asarray([n]), cache)
  last, key, out = logits[0, n - 1], jax.random.key(seed), []
  for _ in range(new_tokens):
    key, sub = jax.random.split(key)
    tok = (jnp.argmax(last) if temperature <= 0 else
           jax.random.categorical(sub, last / temperature))
    out.append(int(tok))
    lg, cache = _step(model, jnp.asarray([tok], jnp.int32), cache)
    last = lg[0]
  return out


def decode_gap(model, tokens: list[int], n: int, max_len: int) -> float:
  """Max |logit| gap between prefill(tokens[:n]) + one decode step per later token and the full
  forward over `tokens` (positions n-1 onwards). max_len: the cache length (>= len(tokens));
  pass the sampler's so its compiled programs are reused."""
  if max_len < len(tokens):
    raise ValueError(f"decode_gap: max_len={max_len} < {len(tokens)} tokens.")
  cache = model.init_cache(1, max_len)
  logits, cache = _prefill(model, jnp.asarray([tokens[:n]], jnp.int32), jnp.asarray([n]), cache)
  decoded = [logits[0, n - 1]]
  for tok in tokens[n:]:
    lg, cache = _step(model, jnp.asarray([tok], jnp.int32), cache)
    decoded.append(lg[0])
  full, _ = _forward(model, jnp.asarray([tokens], jnp.int32))
  return float(jnp.max(jnp.abs(full[0, n - 1:] - jnp.stack(decoded))))


def logged_losses(workdir: str, first: int, stop: int) -> list[float]:
  """The losses <workdir>/metrics.jsonl logged for steps first..stop-1 (step numbers 0-based), in step
  order; a step logged twice (a resumed launch re-ran it) counts its last line, and a line that is
  not a JSON object (one cut short when a launch was killed) is skipped."""
  path = epath.Path(workdir) / "metrics.jsonl"
  by_step = {}
  for line in path.read_text().splitlines() if path.exists() else []:
    try:
      record = json.loads(line)
    except ValueError:
      continue
    if (isinstance(record, dict) and isinstance(record.get("loss"), float)
        and isinstance(record.get("step"), int) and first <= record["step"] < stop):
      by_step[record["step"]] = record["loss"]
  return [by_step[k] for k in sorted(by_step)]


def run(config, workdir: str, *, prompt: str, new_tokens: int, temperature: float) -> dict[str, Any]:
  """Pretrains, reloads, checks decode and samples; returns the numbers the launcher prints.

  Returns:
    final_loss (mean of the last 20 steps' losses; a launch that trained nothing, the run having
    finished, takes the losses of those steps that metrics.jsonl logged, every
    config.metrics.log_every-th; None if none), final_loss_steps (how many it averaged), unigram_entropy,
    loss_over_unigram, decode_max_logit_diff (prefill + decode vs the full forward, with top-k
    covering every key), decode_max_logit_diff_sparse (the same with the config's top-k, where
    near-tied indexer scores may select different keys), sample (the decoded text),
    workdir, checkpoint_dir, latest_checkpoint, steps (the training steps the
    checkpoint holds), steps_this_launch (fewer when it resumed a run),
    mean_tokens_per_s, mean_mfu, seconds.
  """
  missing = [s for s in ("data", "metrics", "checkpoint") if s not in config]
  if missing:
    raise ConfigError(f"the config has no {', '.join(missing)} section(s): the quickstart trains, so pass a "
                      "training config, e.g. --config=configs/pretrain.py:tiny.")
  if not prompt:
    raise ConfigError("--prompt is empty: the sampler continues a prompt of at least one token.")
  if not is_int(new_tokens) or new_tokens < 0:  # a negative count failed in the sampler, after training
    raise ConfigError(f"--new_tokens={new_tokens!r}: must be an int >= 0 (tokens to sample).")
  if not math.isfinite(temperature):  # NaN sampled garbage, after training
    raise ConfigError(f"--temperature={temperature!r}: must be a finite number (<= 0: greedy).")
  if config.data.pipeline != "grain":
    raise ConfigError(f"config.data.pipeline={config.data.pipeline!r}: the quickstart compares the "
                      "loss with the prepared corpus's unigram entropy and samples text, so it needs "
                      "'grain' (a tokenizer and prepared shards).")
  cfg = model_config(config)
  tokenizer = tokenizer_for(config)
  prompt_ids = tokenizer.encode(prompt)
  if len(prompt_ids) + new_tokens + 1 > cfg.max_seq_len:  # checked before training, not after
    raise ConfigError(f"--new_tokens={new_tokens}: the prompt ({len(prompt_ids)} tokens) + new tokens + 1 "
                      f"must fit config.model.max_seq_len={cfg.max_seq_len}; use --new_tokens <= "
                      f"{cfg.max_seq_len - len(prompt_ids) - 1}.")
  t0 = time.perf_counter()
  summary = loop.run(config, workdir)
  entropy = unigram_entropy(summary["prepared_dir"], cfg.vocab_size)
  trained, last = summary["losses"], summary["latest_checkpoint"]
  losses = trained[-20:]
  if not losses:  # the run had already finished: the earlier launches logged its last steps' losses
    losses = logged_losses(workdir, last - 20, last)
  final = float(np.mean(losses)) if losses else None  # None: no loss of the last 20 steps was logged
  model = load_model(summary["checkpoint_dir"], cfg)
  ids = sample(model, prompt_ids, new_tokens, temperature, config.seed)
  tokens = prompt_ids + ids[:-1]
  # The sparse attention's top-k may pick a different key where two indexer scores tie to within
  # f32 rounding (the step-by-step and whole-sequence programs round differently), which moves
  # that position's logits legitimately. The exact check therefore lets top-k cover every key;
  # the trained config's gap is reported beside it.
  max_len = len(prompt_ids) + new_tokens + 1  # the sampler's cache length
  sparse_gap = decode_gap(model, tokens, len(prompt_ids), max_len)
  exact = cfg.replace(index_topk=max(cfg.index_topk, max_len))
  gap = decode_gap(load_model(summary["checkpoint_dir"], exact), tokens, len(prompt_ids), max_len)
  return {"final_loss": final, "final_loss_steps": len(losses), "unigram_entropy": entropy,
          "loss_over_unigram": None if final is None else final / entropy,
          "decode_max_logit_diff": gap, "decode_max_logit_diff_sparse": sparse_gap,
          "sample": tokenizer.decode(ids), "workdir": str(workdir),
          "checkpoint_dir": summary["checkpoint_dir"], "latest_checkpoint": summary["latest_checkpoint"],
          "steps": summary["latest_checkpoint"], "steps_this_launch": len(trained),
          "mean_tokens_per_s": summary["mean_tokens_per_s"],
          "mean_mfu": summary["mean_mfu"], "seconds": round(time.perf_counter() - t0, 1)}
