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

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from array_record.python import array_record_module
from etils import epath

from model.config import model_config
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


def sample(model, prompt_ids: list[int], new_tokens: int, temperature: float, seed: int):
  """Prefill + decode with temperature sampling; also returns the max |logit| gap to the forward."""
  n = len(prompt_ids)
  cache = model.init_cache(1, n + new_tokens + 1)
  prefill = jax.jit(lambda m, x, k, c: m.prefill(x, k, c))
  step = jax.jit(lambda m, x, c: m.decode_step(x, c))
  logits, cache = prefill(model, jnp.asarray([prompt_ids], jnp.int32), jnp.asarray([n]), cache)
  last, key, out, decoded = logits[0, n - 1], jax.random.key(seed), [], []
  for _ in range(new_tokens):
    decoded.append(last)
    key, sub = jax.random.split(key)
    tok = (jnp.argmax(last) if temperature <= 0 else
           jax.random.categorical(sub, last / temperature))
    out.append(int(tok))
    lg, cache = step(model, jnp.asarray([tok], jnp.int32), cache)
    last = lg[0]
  full, _ = jax.jit(lambda m, x: m(x))(model, jnp.asarray([prompt_ids + out[:-1]], jnp.int32))
  gap = float(jnp.max(jnp.abs(full[0, n - 1:] - jnp.stack(decoded))))
  return out, gap


def run(config, workdir: str, *, prompt: str, new_tokens: int, temperature: float) -> dict[str, Any]:
  """Pretrains, reloads, checks decode and samples; returns the numbers the launcher prints.

  Returns:
    final_loss (mean of the last 20 steps' losses), unigram_entropy,
    loss_over_unigram, decode_max_logit_diff, sample (the decoded text),
    workdir, checkpoint_dir, latest_checkpoint, steps (the training steps the
    checkpoint holds), steps_this_launch (fewer when it resumed a run),
    mean_tokens_per_s, mean_mfu, seconds.
  """
  if config.data.pipeline != "grain":
    raise ValueError(f"config.data.pipeline={config.data.pipeline!r}: the quickstart compares the "
                     "loss with the prepared corpus's unigram entropy and samples text, so it needs "
                     "'grain' (a tokenizer and prepared shards).")
  t0 = time.perf_counter()
  summary = loop.run(config, workdir)
  cfg = model_config(config)
  tokenizer = tokenizer_for(config)
  entropy = unigram_entropy(summary["prepared_dir"], cfg.vocab_size)
  losses = summary["losses"]
  final = float(np.mean(losses[-20:])) if losses else float("nan")  # nan: the run had already finished
  model = load_model(summary["checkpoint_dir"], cfg)
  ids, gap = sample(model, tokenizer.encode(prompt), new_tokens, temperature, config.seed)
  return {"final_loss": final, "unigram_entropy": entropy, "loss_over_unigram": final / entropy,
          "decode_max_logit_diff": gap, "sample": tokenizer.decode(ids), "workdir": str(workdir),
          "checkpoint_dir": summary["checkpoint_dir"], "latest_checkpoint": summary["latest_checkpoint"],
          "steps": summary["latest_checkpoint"], "steps_this_launch": len(losses),
          "mean_tokens_per_s": summary["mean_tokens_per_s"],
          "mean_mfu": summary["mean_mfu"], "seconds": round(time.perf_counter() - t0, 1)}
