"""Tests for training/metrics.py: peak FLOP/s, derived metrics (MFU, load ratios), the logger.

The FLOPs-per-token count behind MFU is the model's and is tested in
tests/test_flops.py.
"""

import io
import json
import math
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.moe import MoE
from training import metrics


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
  assert metrics.measure_peak_flops(96, 2, dtype="float32") > 0
  with pytest.raises(ValueError, match="dtype='float16'"):
    metrics.measure_peak_flops(96, 2, dtype="float16")


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
  assert summary["logged_steps"] == 3 and summary["last_step"] == 2
  assert summary["final_loss"] == 2.5 and summary["min_loss"] == 2.0
  assert summary["mean_tokens_per_s"] == pytest.approx(200.0)  # first (compile) step excluded
  assert summary["mean_mfu"] == pytest.approx(0.2)
  assert summary["total_seconds"] > 0
  assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
  out = stream.getvalue().splitlines()  # not a TTY: one plain line per log, then the summary
  assert len(out) == 4 and "\r" not in stream.getvalue()
  assert out[0].startswith("step 1/10 [##") and "loss 3.0000" in out[0] and "MFU 1.00%" in out[0]
  assert "tok/s 300.0" in out[2] and "eta 0m" in out[2]
  assert out[3].startswith("summary: ") and json.loads(out[3][len("summary: "):])["logged_steps"] == 3
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
