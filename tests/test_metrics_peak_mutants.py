"""training/metrics.py's peak FLOP/s (the MFU denominator), where a mutation audit of the benchmarks
found it unpinned: the table's per-chip figures, which device reads the table, the measured matmul's
size, dtypes and precision, and the device count of the total."""

import types

import jax
import jax.numpy as jnp
import pytest

from training import metrics


def test_table_peaks_per_chip():
  # Dense bf16 per chip (vendor pages): H200 SXM as H100 SXM, 989 TFLOP/s (1979 is with sparsity).
  assert metrics.known_peak_flops("NVIDIA H200") == 989e12
  assert metrics.known_peak_flops("TPU v6e") == metrics.known_peak_flops("TPU v6 lite") == 918e12
  assert metrics.known_peak_flops("TPU v5e") == 197e12


def test_total_peak_needs_a_device():
  with pytest.raises(ValueError, match="num_devices=0"):
    metrics.total_peak_flops(5.0, 0, "tpu")
  assert metrics.total_peak_flops(5.0, 1, "gpu") == 5.0


def test_resolve_reads_the_table_off_cpu_and_measures_at_the_given_size(monkeypatch):
  sizes = []
  monkeypatch.setattr(metrics, "measure_peak_flops", lambda n: sizes.append(n) or 123.0)
  gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
  monkeypatch.setattr(metrics.jax, "devices", lambda: [gpu])
  assert metrics.resolve_peak_flops(0) == (989e12, "table: NVIDIA H100 80GB HBM3")
  gpu.device_kind = "NVIDIA A10"  # not in the table: measured
  assert metrics.resolve_peak_flops(0, measure_n=64) == (123.0, "measured: gpu bf16 matmul n=64")
  cpu = types.SimpleNamespace(platform="cpu", device_kind="cpu")
  monkeypatch.setattr(metrics.jax, "devices", lambda: [cpu])
  assert metrics.resolve_peak_flops(0, measure_n=32) == (123.0, "measured: cpu bf16 matmul n=32")
  assert sizes == [64, 32]


def test_measured_matmul_dtypes_and_precision(monkeypatch):
  seen = []
  matmul = jnp.matmul

  def spy(x, y, **kw):
    seen.append((x.shape, x.dtype, y.dtype, kw["preferred_element_type"], kw["precision"]))
    return matmul(x, y, **kw)
  monkeypatch.setattr(metrics.jnp, "matmul", spy)
  metrics.measure_peak_flops(8, 1)
  metrics.measure_peak_flops(8, 1, dtype="float32")
  assert seen == [((8, 8), jnp.bfloat16, jnp.bfloat16, jnp.float32, None),
                  ((8, 8), jnp.float32, jnp.float32, jnp.float32, jax.lax.Precision.HIGHEST)]


def test_measured_peak_is_two_n_cubed_over_the_fastest_run(monkeypatch):
  clock = iter([0.0, 4.0, 10.0, 12.0, 20.0, 23.0])  # runs of 4, 2 and 3 s
  monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
  assert metrics.measure_peak_flops(10, 3) == 2 * 10 ** 3 / 2.0
