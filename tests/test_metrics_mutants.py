"""training/metrics.py edge cases that mutation testing found unpinned: perplexity of a large
(finite) cross-entropy, the eta, and the per-key auxiliary losses."""

import io
import math
import types

import numpy as np
import pytest

from training import metrics


def _derive(raw):
  return metrics.derive_metrics(raw, step_seconds=0.5, tokens=96.0, flops_per_token_train=3.0,
                                peak_flops=7.0, learning_rate=1e-3, router_bias_norm=None)


def test_perplexity_is_exp_ce_up_to_the_overflow():
  for ce, want in ((9.25, 10404.565716560723), (123.0, 2.6195173187490626e53)):
    out = _derive({"loss": ce + 0.125, "ce": ce, "tokens": 90.0, "grad_norm": 1.5})
    assert out["perplexity"] == pytest.approx(want, rel=1e-12)
  assert _derive({"loss": 701.0, "ce": 700.5, "tokens": 90.0, "grad_norm": 1.5})["perplexity"] == math.inf


def test_auxiliary_losses_keep_their_own_values():
  raw = {"loss": 3.5, "ce": 3.0, "tokens": 90.0, "grad_norm": 1.5, "z_loss": 0.0625,
         "seq_aux_loss": 0.3125, "indexer_loss": 0.75, "dropped": np.array([2.0, 5.0, 1.0], np.float32)}
  out = _derive(raw)
  got = (out["z_loss"], out["seq_aux_loss"], out["indexer_kl"], out["dropped"])
  assert got == (0.0625, 0.3125, 0.75, 8.0)
  assert out["tokens_per_s"] == 192.0 and out["mfu"] == pytest.approx(3.0 * 192.0 / 7.0)
  assert "router_bias_norm" not in out and "load/max_over_mean" not in out


def test_eta_counts_the_steps_left_after_this_one(tmp_path, monkeypatch):
  clock = iter([0.0, 100.0, 108.0, 130.0, 131.0])  # logger start, one reading per log, close
  monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
  stream = io.StringIO()
  logger = metrics.MetricsLogger(str(tmp_path), total_steps=10, primary=True, tensorboard=False,
                                 stream=stream)
  logger.log(0, {"loss": 2.0})
  logger.log(4, {"loss": 1.5})  # 8 s for 4 steps: 2 s a step, 5 steps (5..9) left
  logger.log(9, {"loss": 1.0})
  logger.close()
  lines = stream.getvalue().splitlines()
  assert lines[0].endswith("eta ?")
  assert lines[1].startswith("step 5/10 [##########----------]") and lines[1].endswith("eta 0m10s")
  assert lines[2].startswith("step 10/10 [####################]") and lines[2].endswith("eta 0m00s")
