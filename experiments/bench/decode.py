"""Decode tokens/s against the memory-bandwidth roofline, weights in f32 vs in the compute dtype.

    python -m experiments.bench.decode              # small, context 1024, batch 1 and 16
    python -m experiments.bench.decode --quick      # tiny (seconds)

Decoding is memory bound: each step must read every weight the step uses and each row's
decode state once. The roofline is that many bytes over the bandwidth measured here in the
same process (a jitted sum over a 512 MiB array: bytes read per second, the fastest of 5 runs):

  weights: every non-expert weight at the dtype the engine holds it in (the embedding
           table excluded: a step gathers B rows of it); of each MoE layer's routed
           experts, the expected number of distinct experts B tokens select,
           E * (1 - (1 - k/E)^B) (uniform routing);
  state:   per row and DSA layer, the indexer keys of the whole context and the latent +
           RoPE keys of the top-k selected ones; per row and delta layer, the recurrent state
           and conv history, read and written.

Four engines on the same random weights decode B requests of --new_tokens tokens after a
--prompt-token prompt: one holding the weights as stored (f32 masters, each converted to the
compute dtype at every use), one holding compute-dtype copies of the weights the programs only
use in that dtype (serving/weights.py; the same bits), both one decode step per device call
over all slots (batch-invariant), the second again with up to --decode_steps steps per call
(serving/decode_loop.py), and that again computing only the smallest row bucket that holds the
decoding rows (`config.serving.batch_invariant=False`, the serving default). tokens/s counts the
tokens decoded after every row's first one, over the time from the last first token to the last
token (the median of --repeats runs). Last line: JSON with tokens/s, the roofline fraction and
the ratios between the engines.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from configs import serve
from experiments.bench.common import quick_flag, report_cpu
from serving.build import build_engine
from serving.engine import Engine, Request
from serving.types import SamplingParams

_QUICK = quick_flag("tiny model, fewer tokens.")
_PROMPT = flags.DEFINE_integer("prompt", 512, "Prompt tokens per request.", lower_bound=1)
_NEW = flags.DEFINE_integer("new_tokens", 64, "Generated tokens per request (the rate is over those after "
                            "the first, so at least 2).", lower_bound=2)
_BATCHES = flags.DEFINE_list("batches", ["1", "16"], "Concurrent requests (decode batch sizes).")
_STEPS = flags.DEFINE_integer("decode_steps", 8, "Most decode steps per device call (run-ahead).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per engine and batch (the median is reported).",
                                lower_bound=1)


def read_bandwidth(mib: int = 512, reps: int = 5) -> float:
  """Bytes read per second by a jitted sum over an f32 array of `mib` MiB (the fastest of reps).

  The fastest run, as for the peak FLOP/s (training/metrics.measure_peak_flops): a bandwidth is
  what the hardware reaches, and a higher one makes the roofline fraction the conservative figure.
  """
  x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
  f = jax.jit(jnp.sum)
  f(x).block_until_ready()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    f(x).block_until_ready()
    times.append(time.perf_counter() - t0)
  return x.nbytes / min(times)


def step_bytes(engine: Engine, batch: int, context: int) -> dict[str, float]:
  """Bytes one decode step of `batch` rows at `context` tokens must read (see the docstring)."""
  cfg = engine.cfg
  e, k = cfg.num_experts, cfg.experts_per_token
  distinct = e * (1 - (1 - k / e) ** batch) if e else 0.0
  weights = 0.0
  for path, leaf in jax.tree_util.tree_flatten_with_path(engine._state)[0]:
    name = jax.tree_util.keystr(path)
    if "vision" in name or name.startswith("['embed']"):
      continue
    if "['ffn']" in name and any(w in name for w in ("w_gate", "w_up", "w_down")) and leaf.ndim == 3:
      weights += leaf.nbytes / leaf.shape[0] * distinct
    else:
      weights += leaf.nbytes
  dt = jnp.dtype(cfg.jnp_dtype).itemsize
  state = 0.0
  for kind in cfg.layer_kinds:
    if kind == "dsa":
      state += context * cfg.index_head_dim * dt
      state += min(cfg.index_topk, context) * (cfg.kv_lora_rank + cfg.qk_rope_dim) * dt
    else:  # f32 recurrent state and the conv history of the last delta_conv_size - 1 tokens
      conv = (cfg.delta_conv_size - 1) * (2 * cfg.delta_qk_heads * cfg.delta_qk_dim
                                          + cfg.delta_v_heads * cfg.delta_v_dim) * dt
      state += 2 * (cfg.delta_v_heads * cfg.delta_qk_dim * cfg.delta_v_dim * 4 + conv)
  return {"weights": weights, "state": state * batch, "total": weights + state * batch}


def decode_rate(engine: Engine, batch: int, prompt: int, new: int, vocab: int) -> float:
  """Tokens/s of `batch` concurrent requests once all of them decode."""
  rng = np.random.default_rng(batch)
  bos = engine.tokenizer.special_id("bos")  # the only stop id: every request makes `new` tokens
  params = SamplingParams(max_tokens=new, temperature=0.0, stop_token_ids=[bos])
  handles = [engine.submit(Request([int(t) for t in rng.integers(3, 300, prompt)], params))  # no special ids
             for _ in range(batch)]
  firsts, lasts, tokens = [], [], 0
  for h in handles:
    stamps = [ev.time for ev in h.events() for _ in ev.token_ids]
    firsts.append(stamps[0])
    lasts.append(stamps[-1])
    tokens += len(stamps) - 1
  return tokens / (max(lasts) - max(firsts))


def main(argv) -> None:
  del argv
  quick = _QUICK.value
  batches = [int(b) for b in _BATCHES.value]
  config = serve.get_config("tiny" if quick else "small")
  if quick:
    config.model.dtype = "bfloat16"
  prompt, new = (40, 16) if quick else (_PROMPT.value, _NEW.value)
  context = 128 if quick else 1024
  config.serving.update(slots=max(batches), max_context=context, prefix_cache_mb=0, decode_steps=_STEPS.value)
  buckets = build_engine(config)
  kw = dict(slots=buckets.slots, max_context=context, prefill_chunk=buckets.prefill_chunk,
            batch_invariant=True)
  stored = Engine(buckets.model, buckets.tokenizer, compute_dtype_weights=False, decode_steps=1, **kw)
  held = Engine(buckets.model, buckets.tokenizer, decode_steps=1, **kw)
  ahead = Engine(buckets.model, buckets.tokenizer, decode_steps=_STEPS.value, **kw)
  bw = read_bandwidth(64 if quick else 512)
  rows = []
  for name, engine in (("stored f32", stored), ("compute dtype", held),
                       (f"+ {_STEPS.value} steps", ahead), ("+ row buckets", buckets)):
    engine.start()
    try:
      for b in batches:  # compiles every program the timed runs meet (a decode program per bucket)
        decode_rate(engine, b, prompt, 4, held.cfg.vocab_size)
      for b in batches:
        rate = float(np.median([decode_rate(engine, b, prompt, new, held.cfg.vocab_size)
                                for _ in range(_REPEATS.value)]))
        need = step_bytes(held, b, prompt + new // 2)
        roof = b * bw / need["total"]
        rows.append({"weights": name, "batch": b, "tokens_per_s": rate, "roofline": roof,
                     "fraction": rate / roof, "mib_per_step": need["total"] / 2**20})
    finally:
      engine.stop()
  cpu = report_cpu()
  print(f"model {config.serving.model_name} (random weights), compute {held.cfg.dtype}, prompt {prompt}, "
        f"{new} new tokens; read bandwidth {bw / 1e9:.1f} GB/s")
  print(f"{'engine':>14} {'batch':>5} {'tok/s':>8} {'roofline':>9} {'of roof':>8} {'MiB/step':>9}")
  for r in rows:
    print(f"{r['weights']:>14} {r['batch']:>5} {r['tokens_per_s']:>8.1f} {r['roofline']:>9.1f} "
          f"{100 * r['fraction']:>7.1f}% {r['mib_per_step']:>9.1f}")
  by = {(r["weights"], r["batch"]): r for r in rows}

  def ratio(a: str, b: str) -> dict[str, float]:
    return {str(n): round(by[a, n]["tokens_per_s"] / by[b, n]["tokens_per_s"], 2) for n in batches}
  print(json.dumps({"model": config.serving.model_name, "cpu": cpu, "read_gb_per_s": round(bw / 1e9, 2),
                    "tokens_per_s": {f"{w}/{b}": round(r["tokens_per_s"], 1) for (w, b), r in by.items()},
                    "roofline_fraction": {f"{w}/{b}": round(r["fraction"], 4) for (w, b), r in by.items()},
                    "compute_dtype_over_stored": ratio("compute dtype", "stored f32"),
                    "run_ahead_over_one_step": ratio(f"+ {_STEPS.value} steps", "compute dtype"),
                    "buckets_over_all_slots": ratio("+ row buckets", f"+ {_STEPS.value} steps")}))


if __name__ == "__main__":
  app.run(main)
