"""Quickstart: prepare the embedded corpus, pretrain `tiny` on CPU, checkpoint, sample.

    python -m experiments.quickstart --config=configs/pretrain.py:tiny

Runs the real pretraining launcher (experiments/pretrain.py) on the Python
standard library's source (tokenized with the bundled BPE), for
config.train.steps steps (~1-3 minutes on 2 CPU cores), then reloads the last
checkpoint the way the server does, checks that prefill + decode reproduce the
full forward pass, and samples a continuation of a code prompt. Prints the
final loss next to the corpus's unigram entropy (the loss of the best model
that ignores context), where the logs and checkpoints are, and a last line of
JSON.
"""

from __future__ import annotations

import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from array_record.python import array_record_module
from etils import epath

from experiments.config_util import define_config_flag, model_config
from training import data as data_lib
from training import loop as pretrain
from training.checkpoint import load_model

_CONFIG = define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/horizon_quickstart", "Run directory.")
_PROMPT = flags.DEFINE_string("prompt", "def fibonacci(n):\n    ", "Prompt for the sample.")
_NEW = flags.DEFINE_integer("new_tokens", 48, "Tokens to sample.")
_TEMP = flags.DEFINE_float("temperature", 0.7, "Sampling temperature (0 = greedy).")


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


def main(argv):
  del argv
  config, workdir = _CONFIG.value, _WORKDIR.value
  t0 = time.perf_counter()
  summary = pretrain.run(config, workdir)
  cfg = model_config(config)
  tokenizer = pretrain.tokenizer_for(config)
  entropy = unigram_entropy(summary["prepared_dir"], cfg.vocab_size)
  tail = summary["losses"][-20:]
  final = float(np.mean(tail))
  model = load_model(summary["checkpoint_dir"], cfg)
  ids, gap = sample(model, tokenizer.encode(_PROMPT.value), _NEW.value, _TEMP.value, config.seed)
  text = tokenizer.decode(ids)
  print(f"\ncorpus unigram entropy {entropy:.3f} nats/token; final training loss (mean of last "
        f"{len(tail)} steps) {final:.3f} = {final / entropy:.2f} x unigram, perplexity "
        f"{math.exp(final):.1f}")
  print(f"prefill + decode vs full forward: max |logit diff| {gap:.2e}")
  print(f"sample (temperature {_TEMP.value}):\n{_PROMPT.value}{text}\n")
  work = epath.Path(workdir)
  print(f"metrics:     {work / 'metrics.jsonl'} (TensorBoard: {work / 'tensorboard'})")
  print(f"checkpoints: {summary['checkpoint_dir']} (latest step {summary['latest_checkpoint']})")
  print(json.dumps({"final_loss": final, "unigram_entropy": entropy, "loss_over_unigram": final / entropy,
                    "decode_max_logit_diff": gap, "sample": text, "workdir": str(workdir),
                    "checkpoint_dir": summary["checkpoint_dir"], "steps": len(summary["losses"]),
                    "mean_tokens_per_s": summary["mean_tokens_per_s"], "mean_mfu": summary["mean_mfu"],
                    "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
  app.run(main)
