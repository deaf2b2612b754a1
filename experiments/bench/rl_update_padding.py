"""Benchmark: the RL update with every row padded to the batch's longest vs length-grouped micro-batches.

    python -m experiments.bench.rl_update_padding --init_checkpoint=/tmp/horizon_sft/checkpoints
    python -m experiments.bench.rl_update_padding --mixture='math=4,terminal=4,docqa=1,code=1,web=1,cad=1'

An RL batch mixes episodes of very different lengths: a maths episode is ~150 tokens, a tool
episode carries the tool schemas in its prompt and runs to ~700. The trainer scores
(log-probs of the old policy) and differentiates the batch a micro-batch of rows at a time.
`padded` is the update before `config.rl.group_by_length`: consecutive rows, each micro-batch
as long as the batch's longest row. `grouped` sorts rows by length and cuts every micro-batch
to its own longest row (rl/train/batch.py: micro_batches). Both sides compute the same
log-probs for every real token and the same policy gradient (tests/test_bench_rl_update_padding.py
checks this in float32 with the auxiliary losses off). Two things make the reported differences
larger in a real run: the auxiliary losses (the DSA indexer's KL above all) are means per
micro-batch, so regrouping the rows reweights them (grad_rel_diff); and in bf16 a layer's output
can differ by an ulp with the micro-batch's shape, which moves an occasional top-k choice
(|dlogp|: its mean is the figure to read, the max is one token).

The episodes come from one real rollout of the configured run (its engine, environments and
mixture); the timed part is the trainer's work on them: scoring and gradients, no optimizer
step, both sides interleaved after one untimed pass each (compilation). Prints a table and, as
the last line, one JSON object with the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench.common import positive_int
from rl.train import batch as batch_lib
from rl.train import objectives as obj_lib
from rl.train import update as update_lib


def _as_device(arrays: Mapping[str, np.ndarray], rows: np.ndarray, t: int) -> dict[str, jax.Array]:
  return {k: jnp.asarray(v) for k, v in batch_lib.cut(arrays, rows, t).items()}


def _side(model, optimizer, arrays, chunks, obj, tc, put: Callable) -> tuple[float, float, np.ndarray, list]:
  """(score seconds, gradient seconds, log-probs [B, T], summed gradient leaves) of one side."""
  logp = np.zeros_like(arrays["mask"])
  t0 = time.perf_counter()
  for rows, t in chunks:
    logp[rows, :t] = np.asarray(update_lib.score(model, put(arrays, rows, t))[0])
  t_score = time.perf_counter() - t0
  t0 = time.perf_counter()
  grads = None
  for rows, t in chunks:
    g, _ = update_lib.micro_grads(model, optimizer, put(arrays, rows, t), obj, tc, len(chunks))
    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
  leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(grads)]
  return t_score, time.perf_counter() - t0, logp, leaves


def compare(model, optimizer, episodes: Sequence, obj: obj_lib.Objective, tc, *, micro_batch: int,
            pad_multiple: int, reps: int = 2, pad_id: int = 0, put: Callable = _as_device) -> dict:
  """Times both sides on `episodes` (on-policy: logp_old = the rollout's) and checks they agree.

  put(arrays, rows, t): a micro-batch's device arrays (the trainer's mesh placement, or plain).
  """
  rewards = np.array([ep.reward for ep in episodes], np.float64)
  adv = obj_lib.advantages(rewards, batch_lib.group_ids(episodes), obj)
  arrays = batch_lib.to_batch(episodes, adv, obj, pad_multiple=pad_multiple, pad_id=pad_id)
  arrays["logp_old"] = arrays["logp_rollout"].copy()
  lengths = batch_lib.row_lengths(episodes)
  sides = {"padded": batch_lib.micro_batches(lengths, micro_batch, pad_multiple, by_length=False),
           "grouped": batch_lib.micro_batches(lengths, micro_batch, pad_multiple, by_length=True)}
  first = {name: _side(model, optimizer, arrays, chunks, obj, tc, put) for name, chunks in sides.items()}
  times: dict[str, dict[str, list[float]]] = {name: {"score": [], "grads": []} for name in sides}
  for _ in range(reps):
    for name, chunks in sides.items():
      s, g, _, _ = _side(model, optimizer, arrays, chunks, obj, tc, put)
      times[name]["score"].append(s)
      times[name]["grads"].append(g)
  out: dict = {"episodes": len(episodes), "real_tokens": int(sum(lengths)), "sides": {}}
  for name, chunks in sides.items():
    score_ms = 1e3 * statistics.median(times[name]["score"])
    grads_ms = 1e3 * statistics.median(times[name]["grads"])
    out["sides"][name] = {"micro_batches": len(chunks), "lengths": sorted({t for _, t in chunks}),
                          "token_slots": int(sum(len(r) * t for r, t in chunks)),
                          "score_ms": score_ms, "grads_ms": grads_ms, "total_ms": score_ms + grads_ms}
  mask = arrays["mask"] > 0
  dlogp = np.abs(first["padded"][2] - first["grouped"][2])[mask]
  out["logp_max_abs_diff"] = float(np.max(dlogp, initial=0.0))
  out["logp_mean_abs_diff"] = float(np.mean(dlogp)) if dlogp.size else 0.0
  num = sum(float(np.sum((a - b) ** 2)) for a, b in zip(first["padded"][3], first["grouped"][3], strict=True))
  den = sum(float(np.sum(a ** 2)) for a in first["padded"][3])
  out["grad_rel_diff"] = (num / max(den, 1e-300)) ** 0.5
  p, g = out["sides"]["padded"], out["sides"]["grouped"]
  out["speedup"] = p["total_ms"] / g["total_ms"]
  out["slot_ratio"] = p["token_slots"] / g["token_slots"]
  return out


def _print(out: dict, title: str) -> None:
  print(title)
  print(f"{out['episodes']} episodes, {out['real_tokens']} real token positions")
  print("| side | micro-batches | lengths | token slots | score ms | grads ms | total ms |")
  print("|---|---|---|---|---|---|---|")
  for name, s in out["sides"].items():
    print(f"| {name} | {s['micro_batches']} | {','.join(map(str, s['lengths']))} | {s['token_slots']} | "
          f"{s['score_ms']:.0f} | {s['grads_ms']:.0f} | {s['total_ms']:.0f} |")
  print(f"padded/grouped: time {out['speedup']:.2f}x, token slots {out['slot_ratio']:.2f}x; |dlogp| mean "
        f"{out['logp_mean_abs_diff']:.2e} max {out['logp_max_abs_diff']:.2e}, grad rel diff "
        f"{out['grad_rel_diff']:.2e}")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="grpo", help="configs/rl.py argument: <algorithm>[,<variant>]")
  p.add_argument("--init_checkpoint", default=None, help="policy weights (an SFT run's checkpoints)")
  p.add_argument("--mixture", default=None, help="config.rl.mixture (default: the config's)")
  p.add_argument("--prompts", type=int, default=None, help="config.rl.prompts_per_step")
  p.add_argument("--reps", type=positive_int, default=2)
  args = p.parse_args()
  from configs import rl as rl_config
  from rl.train.trainer import RLRun
  from sharding import mesh as mesh_lib

  config = rl_config.get_config(args.config)
  config.metrics.tensorboard = False
  if args.init_checkpoint:
    config.checkpoint.init_from = args.init_checkpoint
  if args.mixture:
    config.rl.mixture = args.mixture
  if args.prompts:
    config.rl.prompts_per_step = args.prompts
  with tempfile.TemporaryDirectory() as workdir, mesh_lib.activate(mesh_lib.make_mesh(config.mesh)):
    r = RLRun(config, workdir)
    r.build()
    try:
      episodes, _, _ = r.rollout(0)
      out = compare(r.model, r.optimizer, episodes, r.obj, r.tc, micro_batch=int(config.rl.micro_batch),
                    pad_multiple=int(config.rl.pad_multiple), reps=args.reps, pad_id=r.tokenizer.pad_id,
                    put=r._micro)
    finally:
      r.close()
  _print(out, f"config {args.config}, mixture {config.rl.mixture}, micro-batch {config.rl.micro_batch} "
              f"rows, pad multiple {config.rl.pad_multiple}, backend {jax.default_backend()}, "
              f"median of {args.reps}")
  print(json.dumps({"config": args.config, "mixture": config.rl.mixture, **out}))


if __name__ == "__main__":
  main()
