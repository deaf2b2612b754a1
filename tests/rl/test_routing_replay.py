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

  grads = nnx.jit(nnx.grad(loss))(model)  # eager: several times the time
  router = [g for path, g in jax.tree_util.tree_leaves_with_path(nnx.state(grads))
            if "w_router" in jax.tree_util.keystr(path)]
  assert router and all(float(jnp.abs(g).max()) > 0 for g in router)


class _FixedLogits:
  """A stand-in model: fixed logits, and a record of the routing it was handed."""

  def __init__(self, logits):
    self.logits, self.routing = logits, "unset"

  def __call__(self, inputs, positions, segment_ids, routing=None, routing_mask=None):
    self.routing = (routing, routing_mask)
    return self.logits, {}


def test_token_logp_and_entropy_match_a_plain_reference():
  """Log-prob of each target and the entropy of each position's distribution, against softmax
  written out per position; replay hands the recorded routing to the model, no replay hands none."""
  rng = np.random.default_rng(0)
  b, t, v = 2, 5, 7
  logits = rng.normal(0, 2, (b, t, v)).astype(np.float32)
  batch = {"inputs": jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32),
           "targets": jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32),
           "positions": jnp.zeros((b, t), jnp.int32), "segment_ids": jnp.ones((b, t), jnp.int32),
           "routing": jnp.zeros((b, t, 1, 1), jnp.int32), "routing_mask": jnp.ones((b, t), jnp.int32)}
  model = _FixedLogits(jnp.asarray(logits))
  logp, entropy, _ = update_lib.token_logp(model, batch, False)
  assert model.routing == (None, None)
  for i in range(b):
    for j in range(t):
      z = np.exp(logits[i, j].astype(np.float64))
      p = z / z.sum()
      target = int(batch["targets"][i, j])
      np.testing.assert_allclose(float(logp[i, j]), np.log(p[target]), rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(float(entropy[i, j]), -np.sum(p * np.log(p)), rtol=1e-5, atol=1e-6)
  update_lib.token_logp(model, batch, True)
  assert model.routing[0] is batch["routing"] and model.routing[1] is batch["routing_mask"]


def test_routing_mismatch_counts_only_recorded_tokens():
  """Expert sets are compared per (token, layer), only where the engine fed the token
  (routing_mask) inside a sequence (segment_ids); the reference loops over every pair."""
  layers, b, t, k = 2, 2, 4, 2
  rng = np.random.default_rng(1)
  recorded = np.stack([rng.permutation(8)[:k] for _ in range(b * t * layers)]).reshape(b, t, layers, k)
  routed = np.moveaxis(recorded[..., ::-1], 2, 0).copy()  # the same sets, listed in another order
  recorded[0, 1, 0], routed[0, 0, 1] = [1, 2], [1, 3]  # differs: row 0, position 1, layer 0
  recorded[1, 0, 1], routed[1, 1, 0] = [4, 5], [6, 7]  # differs: row 1, position 0, layer 1
  recorded[0, 2], routed[:, 0, 2] = -1, [0, 1]  # the engine never fed row 0's position 2
  routed[:, 1, 3] = [[0, 1], [2, 3]]  # row 1's position 3 is padding
  recorded[1, 3] = [[4, 5], [6, 7]]
  mask = (recorded[:, :, 0, 0] >= 0).astype(np.int32)
  segments = np.ones((b, t), np.int32)
  segments[1, 3] = 0
  batch = {"routing": jnp.asarray(recorded, jnp.int32), "routing_mask": jnp.asarray(mask),
           "segment_ids": jnp.asarray(segments)}
  differs = known = 0
  for i in range(b):
    for j in range(t):
      for layer in range(layers):
        if mask[i, j] and segments[i, j]:
          known += 1
          differs += sorted(routed[layer, i, j]) != sorted(recorded[i, j, layer])
  assert (known, differs) == (12, 2)  # 6 fed positions in sequences x 2 layers
  got = float(update_lib.routing_mismatch(jnp.asarray(routed, jnp.int32), batch))
  np.testing.assert_allclose(got, differs / known, rtol=1e-6)
