"""Routing replay (R3): the engine records each token's experts; the trainer replays them."""

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import sft
from rl.agent.executor import ThreadExecutor
from rl.agent.loop import LoopConfig, run_episodes
from rl.agent.policy import EnginePolicy, Sampling
from rl.envs.base import EnvContext
from rl.tasks.generators import math as gen
from rl.train import batch as batch_lib
from rl.train import objectives as obj_lib
from rl.train import update as update_lib
from serving.build import build_engine
from serving.chat import ChatRenderer


@pytest.fixture(scope="module")
def played():
  """Tiny model (f32), 6 sampled math episodes through the engine with routing recorded."""
  config = sft.get_config("tiny")
  engine = build_engine(config).start()
  policy = EnginePolicy(engine, ChatRenderer(engine.tokenizer, 0), dict(config.serving.thinking_budgets),
                        record_routing=True)
  executor = ThreadExecutor(EnvContext(), workers=2)
  tasks = gen.generate(split="train", difficulty=0, n=3)
  jobs = [(t, "low", Sampling(temperature=1.0, seed=i, max_tokens_per_turn=24)) for i, t in
          enumerate(tasks + tasks)]
  try:
    eps = asyncio.run(run_episodes(jobs, policy, executor, concurrency=4,
                                   config=LoopConfig(default_max_turns=1)))
  finally:
    executor.shutdown()
    engine.stop()
  arrays = batch_lib.to_batch(eps, np.zeros(len(eps)), obj_lib.objective("grpo"), pad_multiple=32)
  return engine.model, eps, {k: jnp.asarray(v) for k, v in arrays.items()}


def test_engine_records_every_fed_token(played):
  model, eps, _ = played
  n_moe = sum(k == "moe" for k in model.cfg.ffn_kinds)
  for ep in eps:
    assert ep.routing.shape == (len(ep.token_ids), n_moe, model.cfg.experts_per_token)
    fed = ep.routing[:, 0, 0] >= 0
    assert fed[:-1].all() and not fed[-1]  # every token but the last sampled one was fed
    assert ep.routing[:-1].max() < model.cfg.num_experts


def test_replayed_routing_reproduces_engine_logprobs(played):
  """Same weights in f32: the trainer's log-probs with replay equal the engine's to 1e-5, and
  the trainer's own routing (no replay) picks exactly the recorded experts."""
  model, _, batch = played
  logp, _, mismatch = update_lib.score(model, batch, True)
  mask = np.asarray(batch["mask"]) > 0
  diff = np.abs(np.asarray(logp) - np.asarray(batch["logp_rollout"]))[mask]
  assert mask.sum() > 50 and diff.max() < 1e-5, diff.max()
  _, _, mismatch_own = update_lib.score(model, batch, False)
  assert float(mismatch_own) == 0.0


def test_replay_changes_routing_and_differentiates_the_router(played):
  """Replaying other experts changes the log-probs (replay is used) and the mismatch metric sees
  it; gradients still reach the router weights through the combine weights."""
  model, _, batch = played
  k = model.cfg.num_experts
  shifted = dict(batch, routing=jnp.where(batch["routing"] >= 0, (batch["routing"] + 1) % k, -1))
  base, _, _ = update_lib.score(model, batch, True)
  moved, _, _ = update_lib.score(model, shifted, True)
  mask = np.asarray(batch["mask"]) > 0
  assert np.abs(np.asarray(moved) - np.asarray(base))[mask].max() > 1e-3
  _, _, mismatch = update_lib.score(model, shifted, False)
  assert float(mismatch) == 1.0  # +1 mod E changes every expert set

  def loss(m):
    lp, _, _ = update_lib.token_logp(m, shifted, True)
    return -jnp.sum(lp * batch["mask"])

  grads = nnx.grad(loss)(model)
  router = [g for path, g in jax.tree_util.tree_leaves_with_path(nnx.state(grads))
            if "w_router" in jax.tree_util.keystr(path)]
  assert router and all(float(jnp.abs(g).max()) > 0 for g in router)
