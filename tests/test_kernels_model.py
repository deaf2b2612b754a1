"""The tiny model with config.model.kernels='pallas' (interpret mode on CPU) equals 'xla'."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.decoder import build_model
from tests.helpers import assert_close


def _loss(model, tokens):
  logits, aux = model(tokens)
  tgt = jnp.roll(tokens, -1, axis=1)
  ce = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tgt[..., None], -1)[..., 0]
  return jnp.mean(ce) + 0.1 * aux["indexer_loss"]


@nnx.jit
def _loss_and_grads(model, tokens):
  return nnx.value_and_grad(_loss)(model, tokens)


@pytest.fixture(scope="module")
def two_layers(tiny_cfg):
  """Layer 0 is DSA (dense FFN), layer 1 delta (MoE): every layer kind with a Pallas kernel, once."""
  cfg = tiny_cfg.replace(num_layers=2)
  assert (cfg.layer_kinds, cfg.ffn_kinds) == (("dsa", "delta"), ("dense", "moe"))
  return cfg


@pytest.fixture(scope="module")
def tokens(two_layers):
  # 37 tokens: not a multiple of the DSA query/key blocks or the delta chunk.
  return jax.random.randint(jax.random.key(11), (2, 37), 0, two_layers.vocab_size - 1)


def test_pallas_loss_and_gradients_equal_xla(two_layers, tokens):
  assert not two_layers.use_pallas  # CPU default: the XLA paths
  xla = build_model(dataclasses.replace(two_layers, kernels="xla"), seed=2)
  pallas = build_model(dataclasses.replace(two_layers, kernels="pallas"), seed=2)
  assert pallas.cfg.use_pallas
  lx, gx = _loss_and_grads(xla, tokens)
  lp, gp = _loss_and_grads(pallas, tokens)
  assert_close(lp, lx, what="loss pallas vs xla")
  fx, fp = nnx.to_flat_state(nnx.state(gx)), nnx.to_flat_state(nnx.state(gp))
  assert [p for p, _ in fx] == [p for p, _ in fp]
  for (path, a), (_, b) in zip(fx, fp, strict=True):
    assert_close(b.get_value(), a.get_value(), what="grad " + "/".join(map(str, path)))
  assert sum(float(jnp.sum(jnp.abs(g.get_value()))) > 0 for _, g in fp) > len(fp) // 2


def test_pallas_prefill_and_decode_equal_xla(two_layers, tokens):
  xla = build_model(dataclasses.replace(two_layers, kernels="xla"), seed=2)
  pallas = build_model(dataclasses.replace(two_layers, kernels="pallas"), seed=2)

  @nnx.jit
  def run(m, tok):
    cache = m.init_cache(tok.shape[0], 48)
    logits, cache = m.prefill(tok[:, :30], jnp.asarray([30, 23], jnp.int32), cache)
    step, _ = m.decode_step(tok[:, 30], cache)
    return logits, step

  px, sx = run(xla, tokens)
  pp, sp = run(pallas, tokens)
  assert_close(pp[0], px[0], what="prefill logits row 0")
  assert_close(pp[1, :23], px[1, :23], what="prefill logits row 1 (valid part)")
  assert_close(sp, sx, what="decode step logits")
  assert np.all(np.isfinite(np.asarray(sp)))
