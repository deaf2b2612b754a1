"""Mutation-audit tests for the Gated DSA layer (model/attention/dsa.py): its extend checks and its
choice between the dense and the gathered sparse path, the latter against a reference written out
here (plain numpy top-k and softmax) on random f32 inputs. Its kernels: tests/test_dsa_sparse_mutants.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.attention.dsa import GatedDSA
from tests.helpers import assert_close


def _abstract_dsa(cfg):
  """A GatedDSA with abstract parameters: enough for argument checks, no compile."""
  return nnx.eval_shape(lambda: GatedDSA(cfg, rngs=nnx.Rngs(0)))


def test_dsa_extend_rejects_a_valid_mask_that_is_not_a_prefix(tiny_cfg):
  """valid [False, True, True] would cache two tokens in slots 1 and 2 but count slots 0 and 1 as
  filled (slot 0 all zeros attended as a real key): rejected while the inputs are concrete."""
  layer = _abstract_dsa(tiny_cfg)
  x = np.ones((2, 3, tiny_cfg.d_model), np.float32)
  cache = layer.init_cache(2, 8)
  with pytest.raises(ValueError, match="prefix mask per row"):
    layer.extend(x, np.array([[True, True, False], [False, True, True]]), cache)


def test_dsa_extend_may_fill_the_cache_exactly(tiny_cfg):
  """max_len is a capacity: t == max_len new tokens, or lengths + valid == max_len, is allowed."""
  layer = _abstract_dsa(tiny_cfg)
  d = tiny_cfg.d_model
  layer._check_extend(np.ones((2, 6, d), np.float32), np.ones((2, 6), bool), layer.init_cache(2, 6))
  cache = layer.init_cache(2, 6).replace(lengths=np.array([4, 3], np.int32))
  layer._check_extend(np.ones((2, 2, d), np.float32), np.ones((2, 2), bool), cache)
  with pytest.raises(ValueError, match="would hold 7 tokens"):
    layer._check_extend(np.ones((2, 3, d), np.float32), np.ones((2, 3), bool), cache)


def test_dsa_one_key_more_than_topk_drops_the_lowest_scored_key(tiny_cfg):
  """t = index_topk + 1 in the sparse stage: the last query has one allowed key too many, so it
  attends to all keys but the one with the lowest indexer score (the dense path would keep it).
  Reference: plain numpy top-k and softmax over the layer's projections."""
  cfg = tiny_cfg.replace(indexer_stage="sparse", dsa_dense_len=0)
  t = cfg.index_topk + 1
  layer = GatedDSA(cfg, rngs=nnx.Rngs(3))
  x = jnp.asarray(np.random.default_rng(13).standard_normal((1, t, cfg.d_model)), jnp.float32)
  pos = jnp.arange(t, dtype=jnp.int32)[None]

  @nnx.jit
  def run(layer, x):
    c_q, q_lat, q_rope, latent, k_rope = layer.mla_projections(x, pos)
    y = layer(x, pos, jnp.zeros_like(pos))[0]
    return y, (q_lat, q_rope, latent, k_rope), layer.indexer_projections(x, c_q, pos)

  y, mla, (q_i, w_i, k_i) = run(layer, x)
  q_lat, q_rope, latent, k_rope = (np.asarray(a, np.float64)[0] for a in mla)
  scores = np.einsum("th,ths->ts", np.asarray(w_i, np.float64)[0],
                     np.maximum(np.einsum("thk,sk->ths", np.asarray(q_i, np.float64)[0],
                                          np.asarray(k_i, np.float64)[0]), 0))
  mask = np.tril(np.ones((t, t), bool))
  last = np.sort(scores[-1])
  assert last[1] - last[0] > 1e-3, "near-tie at the top-k boundary; change seed"
  mask[-1, np.argmin(scores[-1])] = False
  logits = (np.einsum("thc,sc->ths", q_lat, latent) + np.einsum("thp,sp->ths", q_rope, k_rope)) * layer.scale
  logits = np.where(mask[:, None, :], logits, -np.inf)
  prob = np.exp(logits - logits.max(-1, keepdims=True))
  prob /= prob.sum(-1, keepdims=True)
  out_lat = np.einsum("ths,sc->thc", prob, latent)[None].astype(np.float32)
  want = jax.jit(lambda o: layer.output_projection(o, x))(jnp.asarray(out_lat))
  assert_close(y, want, what="y")
