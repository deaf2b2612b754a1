"""Rollouts with MXFP4 experts (config.rl.rollout_quantization): the engine generates with a
quantized copy of the dense policy, re-quantized at every weight sync, and the gap shows up in
the off-policy diagnostics that TIS corrects."""

import jax
import numpy as np
import pytest
from flax import nnx

from configs import rl as rl_configs
from model.quant import MXFP4Weight
from sharding import mesh as mesh_lib

pytestmark = pytest.mark.slow  # two tiny trainers with engines: ~1 minute on 2 cores


def _step(tmp_path, quantization):
  from rl.train.trainer import RLRun
  config = rl_configs.get_config("grpo,tiny")
  m = config.model  # tiny with MXFP4's multiples of 32 along contraction axes (as tests/test_quant.py)
  m.d_model, m.expert_dim, m.dense_ffn_dim, m.q_lora_rank, m.kv_lora_rank = 64, 32, 96, 32, 32
  config.rl.rollout_quantization = quantization
  config.metrics.tensorboard = False
  r = RLRun(config, str(tmp_path / quantization), devices=jax.devices()[:1])
  try:
    with mesh_lib.activate(r.mesh):
      r.build()
      quantized = [v for _, v in nnx.iter_graph(r.engine.model) if isinstance(v, MXFP4Weight)]
      assert not any(isinstance(v, MXFP4Weight) for _, v in nnx.iter_graph(r.model))  # trainer: dense
      episodes, _, _ = r.rollout(0)
      metrics = r.update(episodes)
      # the sync after the update re-quantized the *new* policy for the engine
      fresh = jax.tree.leaves(nnx.state(r.rollout_weights()))
      served = jax.tree.leaves(r.engine._state)
      assert len(fresh) == len(served)
      for a, b in zip(fresh, served, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  finally:
    r.close()
  n_moe = sum(k == "moe" for k in r.cfg.ffn_kinds)
  return len(quantized) / (3 * n_moe), [e.reward for e in episodes], metrics


def test_mxfp4_rollouts_are_corrected_against_a_dense_trainer(tmp_path):
  n_dense, _, dense = _step(tmp_path, "none")
  n_quant, rewards, quant = _step(tmp_path, "experts")
  assert n_dense == 0 and n_quant == 1  # w_gate, w_up, w_down of every MoE layer
  assert len(rewards) == 8 and quant["finite"] == 1.0 and np.isfinite(quant["loss"])
  # dense rollouts match the f32 trainer to numerics; MXFP4 ones differ by the quantization
  assert dense["abs_dlogp"] < 1e-3
  assert quant["abs_dlogp"] > 10 * dense["abs_dlogp"] and quant["rollout_kl"] > dense["rollout_kl"]
