"""The train step: accumulation, indexer warm-up, non-finite handling, schedule, decay mask."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import horizon
from model.config import ModelConfig
from model.decoder import Horizon, abstract_model
from model.moe import RouterBias
from tests.helpers import assert_close
from training import byte_corpus
from training import train_step as ts


@pytest.fixture(scope="module")
def setup():
  c = horizon.get_config("tiny_sharded")  # 2 layers: DSA + dense, Delta + MoE
  cfg = ModelConfig.from_config(c.model)
  tc = ts.TrainConfig.from_config(c.train)
  model = Horizon(cfg, rngs=nnx.Rngs(0))
  corpus = byte_corpus.load_stdlib_bytes()
  batch = {k: jnp.asarray(v) for k, v in byte_corpus.lm_rows(corpus, 0, 0, np.arange(4), 24).items()}
  # Padding in the last row: the loss mask must follow segment_ids.
  batch["segment_ids"] = batch["segment_ids"].at[3, 20:].set(0)
  return cfg, tc, nnx.state(model), batch


def _model(cfg, state):
  m = abstract_model(cfg)
  nnx.update(m, jax.tree.map(jnp.copy, state))
  return m


@nnx.jit(static_argnames=("tc",))
def _grads(model, batch, tc):
  return ts._grads(model, batch, tc, nnx.Param)


def test_gradient_accumulation_equals_whole_batch(setup):
  cfg, tc, state, batch = setup
  g1, m1 = _grads(_model(cfg, state), batch, dataclasses.replace(tc, grad_accum=1))
  g2, m2 = _grads(_model(cfg, state), batch, dataclasses.replace(tc, grad_accum=2))
  assert float(m1["tokens"]) == float(m2["tokens"]) == 4 * 24 - 4
  assert_close(m2["loss"], m1["loss"], what="loss")
  np.testing.assert_array_equal(m2["load"], m1["load"])
  # The reported auxiliary losses are the whole batch's (means over micro-batches, not sums).
  for name in ("ce_sum", "z_loss", "seq_aux_loss", "indexer_loss"):
    assert float(m1[name]) > 0, name
    assert_close(m2[name], m1[name], what=name)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g2), strict=True):
    assert_close(b, a, what=f"grad {jax.tree_util.keystr(path)}")


def test_indexer_warmup_trains_only_the_indexer(setup):
  cfg, tc, state, batch = setup
  wcfg = cfg.replace(indexer_stage="dense_warmup")
  model = _model(wcfg, state)
  opt = ts.make_train_state(model, tc)
  metrics = ts.jit_train_step(model, opt, batch, tc)
  assert bool(metrics["finite"])
  before = jax.tree_util.tree_leaves_with_path(nnx.state(_model(wcfg, state), nnx.Param))
  after = jax.tree.leaves(nnx.state(model, nnx.Param))
  changed = {jax.tree_util.keystr(p) for (p, a), b in zip(before, after, strict=True)
             if not np.array_equal(a, b)}
  expect = {"w_qi", "w_ki", "w_w", "index_k_norm"}
  assert changed and all(any(f"'{n}'" in p for n in expect) for p in changed), changed
  assert len(changed) == 5  # w_qi, w_ki, w_w, index_k_norm.{scale,bias} of the one DSA layer


def test_nonfinite_step_is_not_applied_and_named(setup):
  cfg, tc, state, batch = setup
  model = _model(cfg, state)
  model.blocks[1].attn.w_q[...] = model.blocks[1].attn.w_q[...].at[0, 0, 0].set(jnp.nan)
  opt = ts.make_train_state(model, tc)
  metrics = jax.device_get(ts.jit_train_step(model, opt, batch, tc))
  assert not metrics["finite"]
  msg = ts.nonfinite_report(7, metrics, ts.grad_names(model, opt))
  assert msg.startswith("step 7: parameter ['blocks'][1]['attn']['w_q'].value is non-finite")
  # Weights, optimizer moments and router biases are untouched.
  ref = _model(cfg, state)
  np.testing.assert_array_equal(model.blocks[0].attn.w_dq[...], ref.blocks[0].attn.w_dq[...])
  np.testing.assert_array_equal(nnx.state(model, RouterBias)["blocks"][1]["ffn"]["router_bias"][...],
                                nnx.state(ref, RouterBias)["blocks"][1]["ffn"]["router_bias"][...])
  mu = [x for x in jax.tree.leaves(nnx.state(opt)) if getattr(x, "ndim", 0) >= 2]
  assert mu and all(not np.any(np.asarray(x)) for x in mu)
  # A finite step reports nothing.
  assert ts.nonfinite_report(0, {"finite": True}, []) is None


def test_finite_step_updates_weights_and_router_bias(setup):
  cfg, tc, state, batch = setup
  model = _model(cfg, state)
  opt = ts.make_train_state(model, tc)
  metrics = jax.device_get(ts.jit_train_step(model, opt, batch, tc))
  assert metrics["finite"] and np.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
  assert_close(metrics["learning_rate"], tc.learning_rate / tc.warmup_steps, what="first-step lr")
  ref = _model(cfg, state)
  assert not np.array_equal(model.blocks[0].attn.w_dq[...], ref.blocks[0].attn.w_dq[...])
  bias = model.blocks[1].ffn.router_bias[...]
  load = metrics["load"][0]
  np.testing.assert_allclose(bias, tc.router_bias_rate * np.sign(load.mean() - load), rtol=1e-6)


def test_schedule_and_decay_mask(setup):
  cfg, tc, state, _ = setup
  tc = dataclasses.replace(tc, steps=100, warmup_steps=10, learning_rate=1.0, end_lr_fraction=0.1)
  lr = ts.learning_rate_schedule(tc)
  np.testing.assert_allclose([lr(0), lr(4), lr(9)], [0.1, 0.5, 1.0], rtol=1e-6)
  assert float(lr(99)) == pytest.approx(0.1, rel=1e-5)
  assert 0.1 < float(lr(50)) < 1.0
  mask = ts.decay_mask(nnx.state(_model(cfg, state), nnx.Param))
  assert mask["blocks"][1]["attn"]["w_q"].get_value() is True
  for path in (("blocks", 1, "attn", "A_log"), ("blocks", 1, "attn", "dt_bias"), ("final_norm", "scale")):
    node = mask
    for p in path:
      node = node[p]
    assert node.get_value() is False, path


def test_train_config_errors(setup):
  c = horizon.get_config("tiny").train
  c.grad_accum = 3
  with pytest.raises(ValueError, match="global_batch=8 is not divisible by config.train.grad_accum=3"):
    ts.TrainConfig.from_config(c)
  c = horizon.get_config("tiny").train
  c.nan_policy = "ignore"
  with pytest.raises(ValueError, match="nan_policy='ignore'"):
    ts.TrainConfig.from_config(c)
  d = dict(horizon.get_config("tiny").train.items(), group_max_elements=-1)
  with pytest.raises(ValueError, match="group_max_elements=-1: must be an int >= 0"):
    ts.TrainConfig.from_config(d)
  for field, value, rule in (("b2", 1.0, "in [0, 1)"), ("b1", -0.1, "in [0, 1)"), ("eps", 0.0, "> 0"),
                             ("weight_decay", -1e-4, ">= 0"), ("end_lr_fraction", 1.5, "in [0, 1]"),
                             ("warmup_steps", -1, "an int >= 0"),
                             ("grad_clip", -1.0, ">= 0 (0: no clipping)"),
                             ("learning_rate", float("nan"), "a finite number > 0"),  # nan <= 0 is False
                             ("learning_rate", float("inf"), "a finite number > 0"),
                             ("router_bias_rate", -1e-3, "a finite number >= 0"),  # reversed balancing
                             ("z_loss_weight", float("nan"), "a finite number >= 0"),
                             ("seq_aux_weight", -1.0, "a finite number >= 0"),
                             ("indexer_loss_weight", float("inf"), "a finite number >= 0")):
    with pytest.raises(ValueError, match=re.escape(f"config.train.{field}={value!r}: must be {rule}.")):
      ts.TrainConfig.from_config(dict(horizon.get_config("tiny").train.items(), **{field: value}))


def test_grad_clip_zero_turns_clipping_off():
  """A clip to norm 0 would zero every update (the run trains nothing); 0 means no clipping."""
  base = ts.TrainConfig.from_config(dict(horizon.get_config("tiny").train.items(), group_max_elements=0))
  params = {"w": jnp.ones((3, 4)), "b": jnp.ones((4,))}
  grads = {"w": jnp.full((3, 4), 50.0), "b": jnp.full((4,), -20.0)}  # global norm ~ 174
  def first_update(tc):
    tx = ts.make_optimizer(tc)
    return tx.update(grads, tx.init(params), params)[0]
  off = first_update(dataclasses.replace(base, grad_clip=0.0))
  plain = optax.adamw(ts.learning_rate_schedule(base), b1=base.b1, b2=base.b2, eps=base.eps,
                      weight_decay=base.weight_decay, mask=ts.decay_mask(params))
  want = plain.update(grads, plain.init(params), params)[0]
  for k in params:
    np.testing.assert_array_equal(np.asarray(off[k]), np.asarray(want[k]))
    assert float(jnp.max(jnp.abs(off[k]))) > 0, k
  tiny_clip = first_update(dataclasses.replace(base, grad_clip=1e-9))  # clipping on: a different update
  assert not np.array_equal(np.asarray(tiny_clip["w"]), np.asarray(off["w"]))
