"""Tests for training/metrics.py: FLOPs per token, peak FLOP/s, derived metrics, the logger.

The FLOPs count is checked three ways: its weight part against the parameter
counts of `model.param_count` (tiny, small, full), its per-layer terms against
the dot_general FLOPs in the jaxprs of the actual model code (DSA projections,
sparse attention, indexer scores, the whole Delta layer, the triangular
inverse), and its sequence terms against numbers computed by hand.
"""

import io
import json
import math
import sys

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import horizon
from model.attention import sparse
from model.attention.delta import DeltaAttention
from model.attention.delta_rule import unit_lower_inverse
from model.attention.dsa import GatedDSA
from model.config import ModelConfig
from model.moe import MoE
from model.param_count import count_parameters
from training import metrics


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
  f = metrics.flops_per_token(cfg, 4096)
  assert f["embedding"] == 0.0
  # Exactly 2 x every active matrix/conv weight; the 1-D vectors are the only difference.
  assert f["weights"] == 2 * (non_embedding - _vector_params(cfg))
  assert abs(f["weights"] / (2 * non_embedding) - 1) < 1e-2
  # Attention-score terms are extra, not parameters.
  assert f["forward"] == f["weights"] + f["sequence"] and f["sequence"] > 0


def test_sequence_terms_by_hand(tiny_cfg):
  # tiny: 2 DSA layers (h=3, c=22, rope=6, index 3 heads x 12, top-16), 2 Delta layers
  # (hv=4, kd=10, vd=6, chunk 8). T = 20.
  f = metrics.flops_per_token(tiny_cfg, 20)
  # Selected keys min(16, i + 1) over i < 20: (1 + ... + 16 + 4 * 16) / 20 = 200 / 20 = 10.
  # Main attention per key: 3 * (22 + 6) + 3 * 22 = 150 MACs = 300 FLOPs; x 10 keys x 2 layers.
  assert f["dsa_attention"] == pytest.approx(6000.0, rel=1e-12)
  # Indexer per key 3 * 12 + 3 = 39 MACs = 78 FLOPs, over (20 + 1) / 2 causal keys, 2 layers.
  assert f["indexer_scores"] == pytest.approx(1638.0, rel=1e-12)
  assert f["indexer_selected"] == pytest.approx(1560.0, rel=1e-12)  # 78 x 10 selected x 2
  # Delta: 3 chunks of 8 (20 padded to 24). Per chunk and head: 2*64*10 + inverse 7*64
  # + 64*(10+6) + 3*8*10*6 + 64*6 = 1280 + 448 + 1024 + 1440 + 384 = 4576 MACs;
  # x 4 heads x 3 chunks / 20 tokens x 2 FLOPs x 2 layers.
  assert f["delta_chunk"] == pytest.approx(4576 * 4 * 3 / 20 * 2 * 2, rel=1e-12)
  warm = metrics.flops_per_token(tiny_cfg.replace(indexer_stage="dense_warmup"), 20)
  assert warm["dsa_attention"] == pytest.approx(300 * 10.5 * 2, rel=1e-12)  # all causal keys
  assert warm["indexer_selected"] == 0.0


def test_mean_causal_keys_and_inverse_macs():
  assert metrics.mean_causal_keys(5, 3) == pytest.approx(12 / 5)  # 1, 2, 3, 3, 3
  assert metrics.mean_causal_keys(5) == metrics.mean_causal_keys(5, 9) == 3.0
  # 64 = halves of 32 = halves of 16 (substitution: 15 * 256 = 3840);
  # T(32) = 2 * 3840 + 2 * 16^3 = 15872; T(64) = 2 * 15872 + 2 * 32^3 = 97280.
  assert metrics.unit_lower_inverse_macs(64) == 97280
  for m in (8, 17, 32):
    jaxpr = jax.make_jaxpr(unit_lower_inverse)(jnp.ones((m, m), jnp.float32)).jaxpr
    assert dot_flops(jaxpr) == 2 * metrics.unit_lower_inverse_macs(m)


def test_remat_multipliers(tiny_cfg):
  none = metrics.flops_per_token(tiny_cfg, 24)
  full = metrics.flops_per_token(tiny_cfg.replace(remat="full"), 24)
  dots = metrics.flops_per_token(tiny_cfg.replace(remat="save_dots"), 24)
  assert none["train"] == none["train_model"] == 3 * none["forward"]
  assert full["train"] == 4 * full["forward"] and full["train_model"] == 3 * full["forward"]
  assert none["train"] < dots["train"] < full["train"]
  with pytest.raises(ValueError, match="seq_len"):
    metrics.flops_per_token(tiny_cfg, 0)


def test_dsa_terms_match_model_code(tiny_cfg):
  cfg, t = tiny_cfg, 12
  layer = GatedDSA(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(1)
  x, pos = _rand(rng, 1, t, cfg.d_model), jnp.arange(t)[None]

  def projections(x):
    c_q, q_lat, q_rope, latent, k_rope = layer.mla_projections(x, pos)
    q_i, w_i, k_i = layer.indexer_projections(x, c_q, pos)
    return layer.output_projection(jnp.ones_like(q_lat), x), q_i, w_i, k_i, q_rope, latent, k_rope

  f = metrics.flops_per_token(cfg, t)
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
  f = metrics.flops_per_token(cfg, t)
  n = cfg.layer_kinds.count("delta")
  conv = 2 * cfg.delta_conv_size * layer.conv_channels  # depthwise taps: elementwise, not a dot
  assert counted == pytest.approx((f["delta_projections"] - n * conv + f["delta_chunk"]) / n,
                                  rel=1e-12)


# ---------------------------------------------------------------------------
# Peak FLOP/s.
# ---------------------------------------------------------------------------
def test_peak_flops():
  assert math.isfinite(metrics.measure_peak_flops(n=96, reps=2)) and metrics.measure_peak_flops(96, 2) > 0
  assert metrics.resolve_peak_flops(3e12) == (3e12, "config")
  peak, source = metrics.resolve_peak_flops(0, measure_n=96)
  assert peak > 0 and source.startswith("measured: cpu")
  assert metrics.known_peak_flops("TPU v5 lite") == 197e12
  assert metrics.known_peak_flops("TPU v5p") == metrics.known_peak_flops("TPU v5") == 459e12
  assert metrics.known_peak_flops("TPU v4") == 275e12
  assert metrics.known_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
  assert metrics.known_peak_flops("cpu") is None
  assert metrics.total_peak_flops(5.0, 8, "cpu") == 5.0
  assert metrics.total_peak_flops(5.0, 8, "tpu") == 40.0
  for bad in (dict(configured=-1.0), dict(configured=None)):
    with pytest.raises(ValueError, match="configured"):
      metrics.resolve_peak_flops(**bad)
  with pytest.raises(ValueError, match="n="):
    metrics.measure_peak_flops(n=0)


# ---------------------------------------------------------------------------
# Derived metrics.
# ---------------------------------------------------------------------------
RAW = {"loss": 2.5, "ce": 2.0, "tokens": 1000.0, "z_loss": 0.125, "seq_aux_loss": 1.25,
       "indexer_loss": 0.375, "load": np.array([[2.0, 4.0, 6.0, 8.0], [5.0, 5.0, 5.0, 5.0]]),
       "dropped": np.float32(3.0), "grad_norm": 0.75}


def test_derive_metrics():
  out = metrics.derive_metrics(RAW, step_seconds=2.0, tokens=2048, flops_per_token_train=1e6,
                               peak_flops=1e10, learning_rate=3e-4, router_bias_norm=0.5)
  assert out["perplexity"] == pytest.approx(math.exp(2.0))
  assert out["tokens_per_s"] == 1024.0
  assert out["mfu"] == pytest.approx(1e6 * 1024 / 1e10)
  assert out["load/max_over_mean/layer_0"] == pytest.approx(1.6)  # 8 / 5
  assert out["load/min_over_mean/layer_0"] == pytest.approx(0.4)  # 2 / 5
  assert out["load/max_over_mean/layer_1"] == out["load/min_over_mean/layer_1"] == 1.0
  assert out["load/max_over_mean"] == pytest.approx(1.6)
  assert out["load/min_over_mean"] == pytest.approx(0.4)
  expect = {"loss": 2.5, "ce": 2.0, "loss_tokens": 1000.0, "z_loss": 0.125, "seq_aux_loss": 1.25,
            "indexer_kl": 0.375, "dropped": 3.0, "grad_norm": 0.75, "learning_rate": 3e-4,
            "router_bias_norm": 0.5, "step_seconds": 2.0}
  assert {k: out[k] for k in expect} == expect
  assert all(isinstance(v, float) for v in out.values())
  dense = {k: v for k, v in RAW.items() if k not in ("load", "dropped")}
  out = metrics.derive_metrics(dense, step_seconds=1.0, tokens=10, flops_per_token_train=1.0,
                               peak_flops=1.0, learning_rate=0.0, router_bias_norm=None)
  assert not any(k.startswith("load") or k in ("dropped", "router_bias_norm") for k in out)


def test_derive_metrics_errors():
  kw = dict(step_seconds=1.0, tokens=10, flops_per_token_train=1.0, peak_flops=1.0,
            learning_rate=0.0, router_bias_norm=None)
  with pytest.raises(ValueError, match="load"):
    metrics.derive_metrics({**RAW, "load": np.ones(4)}, **kw)
  with pytest.raises(ValueError, match="step_seconds"):
    metrics.derive_metrics(RAW, **{**kw, "step_seconds": 0.0})
  with pytest.raises(ValueError, match="grad_norm"):
    metrics.derive_metrics({k: v for k, v in RAW.items() if k != "grad_norm"}, **kw)


def test_router_bias_norm(tiny_cfg):
  class TwoMoE(nnx.Module):
    def __init__(self):
      self.a, self.b = MoE(tiny_cfg, rngs=nnx.Rngs(0)), MoE(tiny_cfg, rngs=nnx.Rngs(1))

  model = TwoMoE()
  rng = np.random.default_rng(3)
  va, vb = rng.standard_normal(8), rng.standard_normal(8)
  model.a.router_bias[...] = jnp.asarray(va, jnp.float32)
  model.b.router_bias[...] = jnp.asarray(vb, jnp.float32)
  want = math.sqrt(np.sum(va ** 2) + np.sum(vb ** 2))
  assert metrics.router_bias_norm(model) == pytest.approx(want, rel=1e-6)
  assert metrics.router_bias_norm(nnx.Linear(2, 3, rngs=nnx.Rngs(0))) == 0.0


# ---------------------------------------------------------------------------
# Logger.
# ---------------------------------------------------------------------------
def _steps():
  return [{"loss": 3.0, "tokens_per_s": 10.0, "mfu": 0.01, "load/max_over_mean": 1.5},
          {"loss": 2.0, "tokens_per_s": 100.0, "mfu": 0.1, "ignored": np.ones(3)},
          {"loss": 2.5, "tokens_per_s": 300.0, "mfu": 0.3, "perplexity": math.inf}]


def test_logger_files_progress_and_summary(tmp_path):
  stream = io.StringIO()
  logger = metrics.MetricsLogger(str(tmp_path / "run"), total_steps=10, primary=True, stream=stream)
  for step, m in enumerate(_steps()):
    logger.log(step, m)
  lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 3  # flushed per write, before close
  records = [json.loads(line) for line in lines]
  assert [r["step"] for r in records] == [0, 1, 2]
  assert records[0]["load/max_over_mean"] == 1.5 and "ignored" not in records[1]
  assert records[2]["perplexity"] is None  # non-finite -> null keeps the file strict JSON
  summary = logger.close()
  assert summary["steps"] == 3 and summary["last_step"] == 2
  assert summary["final_loss"] == 2.5 and summary["min_loss"] == 2.0
  assert summary["mean_tokens_per_s"] == pytest.approx(200.0)  # first (compile) step excluded
  assert summary["mean_mfu"] == pytest.approx(0.2)
  assert summary["total_seconds"] > 0
  assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
  out = stream.getvalue().splitlines()  # not a TTY: one plain line per log, then the summary
  assert len(out) == 4 and "\r" not in stream.getvalue()
  assert out[0].startswith("step 1/10 [##") and "loss 3.0000" in out[0] and "MFU 1.00%" in out[0]
  assert "tok/s 300.0" in out[2] and "eta 0m" in out[2]
  assert out[3].startswith("summary: ") and json.loads(out[3][len("summary: "):])["steps"] == 3
  with pytest.raises(RuntimeError, match="closed"):
    logger.log(3, {"loss": 1.0})
  # A second run appends to the same JSONL file.
  with metrics.MetricsLogger(str(tmp_path / "run"), total_steps=5, primary=True,
                             tensorboard=False, stream=io.StringIO()) as again:
    again.log(3, {"loss": 1.0})
  assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 4


class _Tty(io.StringIO):
  def isatty(self):
    return True


def test_logger_tty_rewrites_one_line(tmp_path):
  stream = _Tty()
  logger = metrics.MetricsLogger(str(tmp_path), total_steps=3, primary=True, tensorboard=False,
                                 stream=stream)
  for step, m in enumerate(_steps()):
    logger.log(step, m)
  assert stream.getvalue().count("\r") == 3 and "\n" not in stream.getvalue()
  logger.close()
  assert stream.getvalue().count("\n") == 2  # end of the progress line + the summary


def test_logger_non_primary_writes_nothing(tmp_path):
  stream = io.StringIO()
  logger = metrics.MetricsLogger(str(tmp_path / "other"), total_steps=3, primary=False, stream=stream)
  logger.log(0, {"loss": 1.0})
  assert logger.close()["final_loss"] == 1.0
  assert not (tmp_path / "other").exists() and stream.getvalue() == ""


def test_tensorboard_url_support(tmp_path, monkeypatch):
  assert metrics.tensorboard_unsupported(str(tmp_path)) is None
  assert "hdfs" in metrics.tensorboard_unsupported("hdfs://namenode/run")
  monkeypatch.setitem(sys.modules, "google.cloud.storage", None)  # import fails: no GCS client
  assert "google.cloud.storage" in metrics.tensorboard_unsupported("gs://bucket/run")
  with pytest.raises(ValueError, match="total_steps"):
    metrics.MetricsLogger(str(tmp_path), total_steps=0)
