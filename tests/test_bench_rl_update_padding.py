"""experiments/bench/rl_update_padding.py: its two sides (every micro-batch padded to the batch's
longest row, and length-grouped micro-batches cut to their own) give every real token the same
log-prob and add up to the same policy gradient, in float32 with the auxiliary losses off."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from configs import rl as rl_config
from experiments.bench import rl_update_padding as bench
from model.config import model_config
from model.decoder import Horizon
from rl.agent.episode import Episode
from rl.train import objectives as obj_lib
from training.train_step import TrainConfig, make_train_state

pytestmark = pytest.mark.slow  # compiles the tiny model's scoring and gradient at four lengths: ~1 min


def _episodes(vocab: int, lengths, seed: int = 0):
  rng = np.random.default_rng(seed)
  out = []
  for i, n in enumerate(lengths):  # groups of two samples; a prompt, then generation with a tool result
    mask = (np.arange(n) >= n // 3).astype(int)
    mask[n // 2: n // 2 + 3] = 0
    ep = Episode(task_id=f"t{i // 2}", domain="math", tier="high",
                 token_ids=rng.integers(1, vocab, n).tolist(), loss_mask=mask.tolist(),
                 logprobs=(-rng.uniform(0.1, 3.0, n) * mask).tolist(), turns=[])
    ep.reward = float(rng.uniform())
    out.append(ep)
  return out


def test_sides_agree_and_grouping_cuts_padding():
  config = rl_config.get_config("grpo,tiny")
  config.model.update(param_dtype="float32", dtype="float32")
  cfg = model_config(config)
  tc = dataclasses.replace(TrainConfig.from_config(config.train), z_loss_weight=0.0, seq_aux_weight=0.0,
                           indexer_loss_weight=0.0)
  model = Horizon(cfg, rngs=nnx.Rngs(0))
  optimizer = make_train_state(model, tc)
  episodes = _episodes(cfg.vocab_size, [37, 150, 9, 121, 64, 131, 70, 200])
  out = bench.compare(model, optimizer, episodes, obj_lib.objective("grpo"), tc, micro_batch=3,
                      pad_multiple=64, reps=1)
  padded, grouped = out["sides"]["padded"], out["sides"]["grouped"]
  assert padded["lengths"] == [256] and grouped["lengths"] == [64, 128, 256]
  assert (padded["token_slots"], grouped["token_slots"]) == (8 * 256, 3 * 256 + 3 * 128 + 2 * 64)
  assert out["real_tokens"] == sum(n - 1 for n in [37, 150, 9, 121, 64, 131, 70, 200])
  assert out["logp_max_abs_diff"] < 1e-5 and out["logp_mean_abs_diff"] <= out["logp_max_abs_diff"], out
  assert out["grad_rel_diff"] < 1e-5, out
  assert out["speedup"] > 0 and all(s["total_ms"] > 0 for s in out["sides"].values())
