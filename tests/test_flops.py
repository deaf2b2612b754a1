"""Tests for model/flops.py: the FLOPs per token of a config.

The count is checked three ways: its weight part against the parameter
counts of `model.param_count` (tiny, small, full), its per-layer terms against
the dot_general FLOPs in the jaxprs of the actual model code (DSA projections,
sparse attention, indexer scores, the whole Delta layer, the triangular
inverse), and its sequence terms against numbers computed by hand.
"""

import math

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import horizon
from model import flops
from model.attention import sparse
from model.attention.delta import DeltaAttention
from model.attention.delta_rule import unit_lower_inverse
from model.attention.dsa import GatedDSA
from model.config import ModelConfig
from model.param_count import count_parameters


# ---------------------------------------------------------------------------
# A dot_general FLOP counter over jaxprs (scan bodies times their length).
# ---------------------------------------------------------------------------
def _sub_jaxprs(value):
  if isinstance(value, jcore.ClosedJaxpr):
    return [value.jaxpr]
  if isinstance(value, jcore.Jaxpr):
    return [value]
  if isinstance(value, (tuple, list)):
    return [j for v in value for j in _sub_jaxprs(v)]
  return []


def dot_flops(jaxpr) -> float:
  """2 * m * n * k summed over every dot_general, recursing into sub-jaxprs."""
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    assert name not in ("while", "cond", "ragged_dot_general"), f"cannot count through {name}"
    if name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contract)
    reps = eqn.params["length"] if name == "scan" else 1
    total += reps * sum(dot_flops(j) for v in eqn.params.values() for j in _sub_jaxprs(v))
  return total


def _cfg(variant):
  return ModelConfig.from_config(horizon.get_config(variant).model)


def _rand(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


# ---------------------------------------------------------------------------
# FLOPs per token.
# ---------------------------------------------------------------------------
def _vector_params(cfg: ModelConfig) -> int:
  """1-D parameters (norm scales/biases, A_log, dt_bias): used elementwise, not in matmuls."""
  n_dsa, n_delta = cfg.layer_kinds.count("dsa"), cfg.layer_kinds.count("delta")
  per_dsa = cfg.q_lora_rank + cfg.kv_lora_rank + 2 * cfg.index_head_dim  # q/kv RMSNorm, indexer LN
  per_delta = 2 * cfg.delta_v_heads + cfg.delta_v_dim  # A_log, dt_bias, per-head norm scale
  block_norms = 2 * cfg.d_model * cfg.num_layers + cfg.d_model  # attn/ffn norms + final norm
  return n_dsa * per_dsa + n_delta * per_delta + block_norms


@pytest.mark.parametrize("variant", ["tiny", "small", "full"])
def test_weight_flops_equal_twice_active_params(variant):
  cfg = _cfg(variant)
  counts = count_parameters(cfg)
  non_embedding = counts["active"] - counts["components"]["embeddings"]
  f = flops.flops_per_token(cfg, 4096)
  assert f["embedding"] == 0.0
  # Exactly 2 x every active matrix/conv weight; the 1-D vectors are the only difference.
  assert f["weights"] == 2 * (non_embedding - _vector_params(cfg))
  assert abs(f["weights"] / (2 * non_embedding) - 1) < 1e-2
  # Attention-score terms are extra, not parameters.
  assert f["forward"] == f["weights"] + f["sequence"] and f["sequence"] > 0


def test_sequence_terms_by_hand(tiny_cfg):
  # tiny: 2 DSA layers (h=3, c=22, rope=6, index 3 heads x 12, top-16), 2 Delta layers
  # (hv=4, kd=10, vd=6, chunk 8). T = 20.
  f = flops.flops_per_token(tiny_cfg, 20)
  # Selected keys min(16, i + 1) over i < 20: (1 + ... + 16 + 4 * 16) / 20 = 200 / 20 = 10.
  # Main attention per key: 3 * (22 + 6) + 3 * 22 = 150 MACs = 300 FLOPs; x 10 keys x 2 layers.
  assert f["dsa_attention"] == pytest.approx(6000.0, rel=1e-12)
  # Indexer per key 3 * 12 + 3 = 39 MACs = 78 FLOPs, over (20 + 1) / 2 causal keys, 2 layers.
  assert f["indexer_scores"] == pytest.approx(1638.0, rel=1e-12)
  assert f["indexer_selected"] == pytest.approx(1560.0, rel=1e-12)  # 78 x 10 selected x 2
  # Delta: 3 chunks of 8 (20 padded to 24). Per chunk and head: cumsum 64 + 2*64*10
  # + inverse 2*2*512 + 64*(10+6) + 3*8*10*6 + 64*6 = 64 + 1280 + 2048 + 1024 + 1440 + 384
  # = 6240 MACs, + 64 per chunk for the reset count; x 3 chunks / 20 tokens x 2 FLOPs x 2 layers.
  assert f["delta_chunk"] == pytest.approx((6240 * 4 + 64) * 3 / 20 * 2 * 2, rel=1e-12)
  warm = flops.flops_per_token(tiny_cfg.replace(indexer_stage="dense_warmup"), 20)
  assert warm["dsa_attention"] == pytest.approx(300 * 10.5 * 2, rel=1e-12)  # all causal keys
  assert warm["indexer_selected"] == 0.0


def test_mean_causal_keys_and_inverse_macs():
  assert flops.mean_causal_keys(5, 3) == pytest.approx(12 / 5)  # 1, 2, 3, 3, 3
  assert flops.mean_causal_keys(5) == flops.mean_causal_keys(5, 9) == 3.0
  # 64 = halves of 32 = halves of 16 = halves of 8 (product form: 2 * 2 * 8^3 = 2048);
  # T(16) = 2 * 2048 + 2 * 8^3 = 5120; T(32) = 2 * 5120 + 2 * 16^3 = 18432;
  # T(64) = 2 * 18432 + 2 * 32^3 = 102400. 17 is padded to 32.
  assert flops.unit_lower_inverse_macs(64) == 102400
  assert flops.unit_lower_inverse_macs(17) == flops.unit_lower_inverse_macs(32)
  for m in (8, 17, 32):
    jaxpr = jax.make_jaxpr(unit_lower_inverse)(jnp.ones((m, m), jnp.float32)).jaxpr
    assert dot_flops(jaxpr) == 2 * flops.unit_lower_inverse_macs(m)


def test_remat_multipliers(tiny_cfg):
  none = flops.flops_per_token(tiny_cfg, 24)
  full = flops.flops_per_token(tiny_cfg.replace(remat="full"), 24)
  dots = flops.flops_per_token(tiny_cfg.replace(remat="save_dots"), 24)
  assert none["train"] == none["train_model"] == 3 * none["forward"]
  # 'full' recomputes the blocks, not the LM head that runs after them (it counted 4 x forward).
  assert full["train"] == 4 * full["forward"] - full["lm_head"] and full["train_model"] == 3 * full["forward"]
  assert none["train"] < dots["train"] < full["train"]
  with pytest.raises(ValueError, match="seq_len"):
    flops.flops_per_token(tiny_cfg, 0)


def test_dsa_terms_match_model_code(tiny_cfg):
  cfg, t = tiny_cfg, 12
  layer = GatedDSA(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(1)
  x, pos = _rand(rng, 1, t, cfg.d_model), jnp.arange(t)[None]

  def projections(x):
    c_q, q_lat, q_rope, latent, k_rope = layer.mla_projections(x, pos)
    q_i, w_i, k_i = layer.indexer_projections(x, c_q, pos)
    return layer.output_projection(jnp.ones_like(q_lat), x), q_i, w_i, k_i, q_rope, latent, k_rope

  f = flops.flops_per_token(cfg, t)
  n = cfg.layer_kinds.count("dsa")
  per_token = dot_flops(jax.make_jaxpr(projections)(x).jaxpr) / t
  assert per_token == (f["dsa_projections"] + f["indexer_projections"]) / n
  # Per selected key, from the attention and indexer code themselves (j slots per query).
  h, c, p, hi, di, j = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_dim, 3, cfg.index_head_dim, 5
  idx = jnp.asarray(rng.integers(0, t, (1, t, j)), jnp.int32)
  att = jax.make_jaxpr(lambda *a: sparse.sparse_mqa_attention(*a, idx, idx >= 0, 0.3, 4))(
      _rand(rng, 1, t, h, c), _rand(rng, 1, t, h, p), _rand(rng, 1, t, c), _rand(rng, 1, t, p))
  assert dot_flops(att.jaxpr) / (t * j) == 2 * (h * (c + p) + h * c)
  q_i, w_i, k_i = _rand(rng, 1, t, hi, di), _rand(rng, 1, t, hi), _rand(rng, 1, t, di)
  sel = jax.make_jaxpr(lambda *a: sparse.selected_indexer_scores(*a, idx, 4))(q_i, w_i, k_i)
  dense = jax.make_jaxpr(sparse.indexer_scores_dense)(q_i, w_i, k_i)
  assert dot_flops(sel.jaxpr) / (t * j) == dot_flops(dense.jaxpr) / (t * t) == 2 * (hi * di + hi)
  # Hence the per-layer totals: (T + 1) / 2 dense indexer keys and mean min(k, i + 1) selected.
  assert f["indexer_scores"] / n == 2 * (hi * di + hi) * (t + 1) / 2


def test_delta_layer_matches_model_code(tiny_cfg):
  cfg, t = tiny_cfg, 21  # 3 chunks of 8, the last one padded
  layer = DeltaAttention(cfg, rngs=nnx.Rngs(0))
  x = _rand(np.random.default_rng(2), 1, t, cfg.d_model)
  counted = dot_flops(jax.make_jaxpr(lambda x: layer(x)[0])(x).jaxpr) / t
  f = flops.flops_per_token(cfg, t)
  n = cfg.layer_kinds.count("delta")
  conv = 2 * cfg.delta_conv_size * layer.conv_channels  # depthwise taps: elementwise, not a dot
  assert counted == pytest.approx((f["delta_projections"] - n * conv + f["delta_chunk"]) / n,
                                  rel=1e-12)
