"""One RL update moves probability toward the samples that did better than their group: the
change in each sequence's log-probability follows its advantage (sign and ordering)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import rl as rl_configs
from sharding import mesh as mesh_lib

pytestmark = pytest.mark.slow  # a tiny trainer with its engine: ~1 minute on 2 cores


def test_update_raises_logp_of_better_samples(tmp_path):
  from rl.train import batch as batch_lib
  from rl.train import objectives as obj_lib
  from rl.train import update as update_lib
  from rl.train.trainer import RLRun
  config = rl_configs.get_config("grpo,tiny")
  config.rl.prompts_per_step = 4  # 4 groups of 4 samples
  config.metrics.tensorboard = False
  r = RLRun(config, str(tmp_path), devices=jax.devices()[:1])
  try:
    with mesh_lib.activate(r.mesh):
      r.build()
      episodes, _, _ = r.rollout(0)
      rewards, _ = batch_lib.shape_rewards(episodes, r.obj, r.shaping, r.think_end)
      adv = obj_lib.advantages(rewards, batch_lib.group_ids(episodes), r.obj)
      arrays = batch_lib.to_batch(episodes, np.zeros(len(episodes)), r.obj, pad_multiple=64,
                                  pad_id=r.tokenizer.pad_id)
      batch = {k: jnp.asarray(v) for k, v in arrays.items()}
      before = np.asarray(update_lib.score(r.model, batch)[0])
      r.update(episodes)
      after = np.asarray(update_lib.score(r.model, batch)[0])
  finally:
    r.close()
  assert np.any(adv > 0) and np.any(adv < 0), f"no group with mixed rewards to learn from: {rewards}"
  moved = ((after - before) * arrays["mask"]).sum(1)
  assert np.all(moved[adv > 0] > 0), (adv, moved)
  assert moved[adv > 0].min() > moved[adv < 0].max(), (adv, moved)
  assert np.corrcoef(adv, moved)[0, 1] > 0.5
