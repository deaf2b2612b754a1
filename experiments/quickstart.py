"""Quickstart: build a model from a config, run a forward pass and decode a few tokens.

    python -m experiments.quickstart --config=configs/horizon.py:tiny

Prints the layer pattern, parameter counts, the forward pass's shapes and
auxiliary losses, and greedy decode steps from a random-init model; checks that
prefill + decode reproduces the full forward's logits. Last line: JSON.
"""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.config_util import define_config_flag, model_config
from model.decoder import build_model
from model.param_count import count_parameters

_CONFIG = define_config_flag()
_BATCH = flags.DEFINE_integer("batch", 2, "Rows in the demo batch.")
_PROMPT = flags.DEFINE_integer("prompt_len", 24, "Prompt length (rows get different lengths).")
_STEPS = flags.DEFINE_integer("decode_steps", 8, "Greedy decode steps.")


def main(argv):
  del argv
  cfg = model_config(_CONFIG.value)
  counts = count_parameters(cfg)
  print(f"layers: {' '.join(f'{a}/{f}' for a, f in zip(cfg.layer_kinds, cfg.ffn_kinds, strict=True))}")
  print(f"params: total {counts['total']:,} active {counts['active']:,} vision {counts['vision']:,}")

  t0 = time.perf_counter()
  model = build_model(cfg, seed=_CONFIG.value.seed)
  b, t = _BATCH.value, _PROMPT.value
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, cfg.image_token_id, (b, t + _STEPS.value)), jnp.int32)
  forward = jax.jit(lambda m, x: m(x))
  logits, aux = forward(model, tokens)
  print(f"forward: tokens {tokens.shape} -> logits {logits.shape} {logits.dtype}; "
        f"indexer_loss {float(aux['indexer_loss']):.4f} z_loss {float(aux['z_loss']):.4f} "
        f"load/layer {np.asarray(aux['load']).sum(-1).tolist()}")

  lengths = jnp.asarray([t - 3 * i for i in range(b)], jnp.int32)
  cache = model.init_cache(b, t + _STEPS.value + 1)
  prefill = jax.jit(lambda m, x, n, c: m.prefill(x, n, c))
  step = jax.jit(lambda m, x, c: m.decode_step(x, c))
  pl, cache = prefill(model, tokens[:, :t], lengths, cache)
  nxt = jnp.argmax(pl[jnp.arange(b), lengths - 1], -1)
  generated, max_err = [nxt], 0.0
  for _ in range(_STEPS.value - 1):
    lg, cache = step(model, nxt, cache)
    nxt = jnp.argmax(lg, -1)
    generated.append(nxt)
  # Check: teacher-forced full forward over each row's prompt + generated tokens.
  gen = np.stack([np.asarray(g) for g in generated], 1)
  for r in range(b):
    n = int(lengths[r])
    seq = jnp.concatenate([tokens[r, :n], jnp.asarray(gen[r])])[None]
    full, _ = forward(model, seq)
    pred = np.asarray(jnp.argmax(full[0, n - 1:-1], -1))
    max_err = max(max_err, float(np.mean(pred != gen[r])))
  print(f"decode: {_STEPS.value} greedy steps, rows' prompt lengths {lengths.tolist()}")
  for r in range(b):
    print(f"  row {r}: {gen[r].tolist()}")
  print(f"prefill+decode vs full forward: greedy token mismatch rate {max_err:.3f}")
  print(json.dumps({"total_params": counts["total"], "active_params": counts["active"],
                    "logits_shape": list(logits.shape), "decode_steps": _STEPS.value,
                    "decode_mismatch_rate": max_err, "seconds": round(time.perf_counter() - t0, 2)}))


if __name__ == "__main__":
  app.run(main)
