"""Training metrics: peak FLOP/s, MFU and the other logged metrics, and the metrics logger.

Model FLOPs utilisation (MFU) is the FLOP/s the model's own maths needs at the
measured tokens/s, divided by the hardware's peak (PaLM, Chowdhery et al. 2022,
appendix B). The numerator, FLOPs per token, is the model's own description
(`model.flops.flops_per_token`); this module supplies the peak (a table of
known accelerators, or a measured bf16 matmul) and turns a step's raw metrics
into the logged ones.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from model.moe import RouterBias

# ---------------------------------------------------------------------------
# Peak FLOP/s.
# ---------------------------------------------------------------------------
# Dense bf16 peak per chip, matched by substring of jax's device_kind (lower
# case, first match wins). Sources: Google Cloud TPU system-architecture pages
# (v4 275 TF, v5e 197 TF, v5p 459 TF, v6e 918 TF per chip); NVIDIA H100/H200
# SXM datasheets (989.4 TF dense BF16 Tensor Core; PCIe/NVL parts are lower --
# set metrics.peak_flops for those).
KNOWN_PEAK_FLOPS = (("tpu v5 lite", 197e12), ("tpu v5e", 197e12), ("tpu v5p", 459e12),
                    ("tpu v5", 459e12), ("tpu v6 lite", 918e12), ("tpu v6e", 918e12),
                    ("tpu v4", 275e12), ("h100", 989e12), ("h200", 989e12))


def known_peak_flops(device_kind: str) -> float | None:
  """The table's peak for a jax `device_kind` string, or None if it is not listed."""
  kind = device_kind.lower()
  for key, peak in KNOWN_PEAK_FLOPS:
    if key in kind:
      return peak
  return None


def measure_peak_flops(n: int = 2048, reps: int = 5, dtype: str = "bfloat16") -> float:
  """Measured matmul FLOP/s of the default device: [n, n] @ [n, n] in `dtype`, f32 accumulation.

  Jitted and compiled first (compile and one warm-up run excluded); returns 2 n^3 / the
  fastest of `reps` timed runs. A peak is what the hardware reaches, and the fastest run is the
  conservative figure for MFU: on a 2-core AMD EPYC, bf16 n=1024 ran at 438-444 GFLOP/s in
  most runs and at about half that (one core's worth) in the rest, so the median of 10 runs
  landed at 223 in one trial of three. dtype "bfloat16" (the default) is the MFU
  denominator. "float32" is its cross-check on CPUs: where bf16 runs on the f32 vector units
  through a two-wide dot-product instruction (AVX512-BF16), bf16 peaks at about twice f32; a
  matrix unit (AMX, an MXU, tensor cores) gives far more, and a bf16 probe near or below f32
  means it missed the bf16 path.
  """
  if not isinstance(n, int) or n < 1 or not isinstance(reps, int) or reps < 1:
    raise ValueError(f"measure_peak_flops: n={n!r} and reps={reps!r} must be positive ints.")
  if dtype not in ("bfloat16", "float32"):
    raise ValueError(f"measure_peak_flops: dtype={dtype!r}; choose 'bfloat16' or 'float32'.")
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
  b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
  # HIGHEST keeps an f32 probe in f32 on backends whose default rounds f32 inputs (TF32, bf16).
  precision = jax.lax.Precision.HIGHEST if dtype == "float32" else None
  matmul = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32, precision=precision))
  compiled = matmul.lower(a, b).compile()
  jax.block_until_ready(compiled(a, b))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(a, b))
    times.append(time.perf_counter() - t0)
  return 2.0 * n ** 3 / min(times)


def resolve_peak_flops(configured: float, *, measure_n: int = 2048) -> tuple[float, str]:
  """Peak FLOP/s of ONE device and where it came from (for the log).

  configured > 0 wins ('config'); on CPU the peak is measured
  (`measure_peak_flops`, 'measured'); a device in KNOWN_PEAK_FLOPS gets the
  table's figure ('table: <device_kind>'); anything else is measured.
  """
  if configured is None or configured < 0:
    raise ValueError(f"resolve_peak_flops: configured={configured!r}; give a peak in FLOP/s per "
                     "device, or 0 to measure / look it up.")
  if configured > 0:
    return float(configured), "config"
  device = jax.devices()[0]
  if device.platform != "cpu":
    peak = known_peak_flops(device.device_kind)
    if peak is not None:
      return peak, f"table: {device.device_kind}"
  return measure_peak_flops(measure_n), f"measured: {device.platform} bf16 matmul n={measure_n}"


def total_peak_flops(per_device: float, num_devices: int, platform: str) -> float:
  """Peak of all devices a step runs on: per_device x num_devices, except on CPU.

  Fake CPU devices (--xla_force_host_platform_device_count) share one host's
  cores, and the CPU measurement already uses them all, so there the host's
  figure is the total.
  """
  if num_devices < 1:
    raise ValueError(f"total_peak_flops: num_devices={num_devices} must be >= 1.")
  return per_device if platform == "cpu" else per_device * num_devices


# ---------------------------------------------------------------------------
# Derived metrics.
# ---------------------------------------------------------------------------
def load_ratios(load: Any) -> dict[str, float]:
  """Per-MoE-layer and overall expert load max/mean and min/mean from [n_moe, e] counts."""
  load = np.asarray(load, np.float64)
  if load.ndim != 2 or load.shape[1] < 1:
    raise ValueError(f"derive_metrics: raw['load'] must be [num_moe_layers, num_experts], got shape "
                     f"{load.shape}; pass train_step's per-layer loads (gathered to the host).")
  mean = load.mean(axis=1)
  safe = np.where(mean > 0, mean, np.nan)  # a layer that saw no tokens has no ratio
  hi, lo = load.max(axis=1) / safe, load.min(axis=1) / safe
  out = {}
  for i in range(load.shape[0]):
    out[f"load/max_over_mean/layer_{i}"] = float(hi[i])
    out[f"load/min_over_mean/layer_{i}"] = float(lo[i])
  out["load/max_over_mean"] = float(np.nanmax(hi)) if np.any(np.isfinite(hi)) else math.nan
  out["load/min_over_mean"] = float(np.nanmin(lo)) if np.any(np.isfinite(lo)) else math.nan
  return out


def derive_metrics(raw: dict, *, step_seconds: float, tokens: float, flops_per_token_train: float,
                   peak_flops: float, learning_rate: float, router_bias_norm: float | None) -> dict:
  """The logged metrics of one step from train_step's raw metrics (pure; host values).

  Args:
    raw: training.train_step.train_step's metrics (loss, ce, tokens = loss
      tokens, z_loss, seq_aux_loss, indexer_loss, grad_norm; with MoE layers
      also load [n_moe, e] and dropped), as host scalars / numpy.
    step_seconds: wall time of the step.
    tokens: tokens the step processed (global batch x seq_len, padding too:
      the compute is spent on them).
    flops_per_token_train: model.flops.flops_per_token(...)['train'] (or 'train_model').
    peak_flops: peak FLOP/s of all devices running the step (total_peak_flops).
    learning_rate: the schedule's value at this step.
    router_bias_norm: `router_bias_norm(model)`, or None to leave it out.

  Returns:
    Flat {name: float}: loss, ce, perplexity (exp(ce)), loss_tokens, z_loss,
    seq_aux_loss, indexer_kl, grad_norm, learning_rate, step_seconds,
    tokens_per_s, mfu, and with MoE layers dropped and
    load/{max,min}_over_mean[/layer_<i>]; router_bias_norm when given.
  """
  for name, value in (("step_seconds", step_seconds), ("tokens", tokens),
                      ("peak_flops", peak_flops)):
    if not value > 0:
      raise ValueError(f"derive_metrics: {name}={value!r} must be > 0.")
  missing = [k for k in ("loss", "ce", "tokens", "grad_norm") if k not in raw]
  if missing:
    raise ValueError(f"derive_metrics: raw metrics lack {missing}; pass train_step's metrics dict.")
  ce = float(raw["ce"])
  out = {"loss": float(raw["loss"]), "ce": ce,
         "perplexity": math.exp(ce) if ce < 700 else math.inf,
         "loss_tokens": float(raw["tokens"]), "grad_norm": float(raw["grad_norm"])}
  for key in ("z_loss", "seq_aux_loss"):
    if key in raw:
      out[key] = float(raw[key])
  if "indexer_loss" in raw:
    out["indexer_kl"] = float(raw["indexer_loss"])
  tokens_per_s = tokens / step_seconds
  out.update(learning_rate=float(learning_rate), step_seconds=float(step_seconds),
             tokens_per_s=tokens_per_s, mfu=flops_per_token_train * tokens_per_s / peak_flops)
  if "dropped" in raw:
    out["dropped"] = float(np.sum(np.asarray(raw["dropped"])))
  if "load" in raw:
    out.update(load_ratios(raw["load"]))
  if router_bias_norm is not None:
    out["router_bias_norm"] = float(router_bias_norm)
  return out


@jax.jit
def _global_norm(leaves: list[jax.Array]) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def router_bias_norm(model: nnx.Module) -> float:
  """Global L2 norm over all `model.moe.RouterBias` variables (0.0 if there are none)."""
  leaves = jax.tree.leaves(nnx.state(model, RouterBias))
  return float(_global_norm(leaves)) if leaves else 0.0


# ---------------------------------------------------------------------------
# Logger: TensorBoard + JSONL + console progress.
# ---------------------------------------------------------------------------
def tensorboard_unsupported(workdir: str) -> str | None:
  """Why tensorboardX cannot write event files under `workdir`, or None if it can.

  tensorboardX writes local paths, s3:// (with boto3) and gs:// (with
  google-cloud-storage); any other URL scheme, or a missing client library,
  cannot be written.
  """
  scheme, sep, _ = str(workdir).partition("://")
  if not sep:
    return None
  needs = {"s3": "boto3", "gs": "google.cloud.storage"}
  if scheme not in needs:
    return f"tensorboardX cannot write {scheme}:// URLs"
  try:
    __import__(needs[scheme])
  except ImportError:
    return f"tensorboardX needs the {needs[scheme]} package to write {scheme}:// URLs"
  return None


def _scalar(value: Any) -> float | int | str | None:
  """A JSON/TensorBoard-ready scalar, or None for values that are not scalars."""
  if isinstance(value, str):
    return value
  if isinstance(value, (bool, np.bool_)):
    return int(value)
  if isinstance(value, (int, np.integer)):
    return int(value)
  arr = np.asarray(value)
  if arr.ndim == 0 and np.issubdtype(arr.dtype, np.number):
    return float(arr)
  return None


def _json_safe(value: Any) -> Any:
  return None if isinstance(value, float) and not math.isfinite(value) else value


def _fmt_count(x: float) -> str:
  for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(x) >= scale:
      return f"{x / scale:.2f}{unit}"
  return f"{x:.1f}"


def _fmt_duration(seconds: float) -> str:
  seconds = int(round(seconds))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class MetricsLogger:
  """Writes per-step metrics to TensorBoard, `metrics.jsonl` and a console progress line.

  Only the primary process (jax.process_index() == 0 unless `primary` says
  otherwise) writes; every process keeps the records, so `summary()` works
  everywhere. `workdir` may be local or a URL (etils.epath); where tensorboardX
  cannot write the URL, TensorBoard is skipped with a warning and the JSONL
  file is still written.

  Use as a context manager, or call `close()` at the end (prints the summary).
  """

  def __init__(self, workdir: str, *, total_steps: int, tensorboard: bool = True,
               primary: bool | None = None, stream: TextIO | None = None,
               console_keys: tuple[str, ...] = ()):
    if not isinstance(total_steps, int) or total_steps < 1:
      raise ValueError(f"MetricsLogger: total_steps={total_steps!r} must be a positive int.")
    self.workdir = epath.Path(workdir)
    self.total_steps = total_steps
    self.primary = jax.process_index() == 0 if primary is None else bool(primary)
    self._stream = stream or sys.stdout
    self.console_keys = tuple(console_keys)  # more scalars for the progress line (e.g. RL's reward)
    self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
    self._records: list[dict] = []
    self._times: list[float] = []
    self._t0 = time.perf_counter()
    self._line_len = 0
    self._jsonl = self._tb = None
    self._closed = False
    if not self.primary:
      return
    self.workdir.mkdir(parents=True, exist_ok=True)
    self._jsonl = (self.workdir / "metrics.jsonl").open("a")
    if tensorboard:
      self._tb = self._open_tensorboard()

  def _open_tensorboard(self):
    reason = tensorboard_unsupported(str(self.workdir))
    if reason is None:
      try:
        from tensorboardX import SummaryWriter
        return SummaryWriter(logdir=str(self.workdir / "tensorboard"))
      except Exception as e:  # any writer failure costs only TensorBoard, never the run
        reason = f"tensorboardX failed: {e!r}"
    logging.warning("MetricsLogger: skipping TensorBoard under %s (%s); metrics.jsonl is still "
                    "written.", self.workdir, reason)
    return None

  @property
  def tensorboard_dir(self) -> epath.Path | None:
    """Where event files go, or None when TensorBoard is off or skipped."""
    return self.workdir / "tensorboard" if self._tb is not None else None

  def log(self, step: int, metrics: dict) -> None:
    """Records one step: JSONL line, TensorBoard scalars, progress line (primary only).

    Args:
      step: the optimizer step (0-based).
      metrics: {name: scalar}; non-scalar values are left out.
    """
    if self._closed:
      raise RuntimeError("MetricsLogger.log: the logger is closed.")
    record = {"step": int(step)}
    for name, value in metrics.items():
      v = _scalar(value)
      if v is not None and name != "step":
        record[name] = v
    self._records.append(record)
    self._times.append(time.perf_counter())
    if not self.primary:
      return
    self._jsonl.write(json.dumps({k: _json_safe(v) for k, v in record.items()}) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for name, value in record.items():
        if name != "step" and not isinstance(value, str):
          self._tb.add_scalar(name, value, global_step=record["step"])
      self._tb.flush()
    self._progress(record)

  def _eta(self, step: int) -> str:
    if len(self._records) < 2 or step <= self._records[0]["step"]:
      return "?"
    per_step = (self._times[-1] - self._times[0]) / (step - self._records[0]["step"])
    return _fmt_duration(per_step * max(self.total_steps - step - 1, 0))

  def progress_line(self, record: dict) -> str:
    """The console line for a record: step/total, bar, loss, tokens/s, MFU, eta."""
    step = record["step"]
    done = min(max((step + 1) / self.total_steps, 0.0), 1.0)
    bar = "#" * int(done * 20) + "-" * (20 - int(done * 20))
    parts = [f"step {step + 1}/{self.total_steps} [{bar}]"]
    if isinstance(record.get("loss"), float):
      parts.append(f"loss {record['loss']:.4f}")
    if isinstance(record.get("tokens_per_s"), float):
      parts.append(f"tok/s {_fmt_count(record['tokens_per_s'])}")
    if isinstance(record.get("mfu"), float):
      parts.append(f"MFU {100 * record['mfu']:.2f}%")
    parts += [f"{k} {record[k]:.3g}" for k in self.console_keys if isinstance(record.get(k), float)]
    parts.append(f"eta {self._eta(step)}")
    return " | ".join(parts)

  def _progress(self, record: dict) -> None:
    line = self.progress_line(record)
    if self._tty:  # rewrite one line in place
      self._stream.write("\r" + line.ljust(self._line_len))
      self._line_len = len(line)
    else:
      self._stream.write(line + "\n")
    self._stream.flush()

  def summary(self) -> dict:
    """Final and min loss, mean tokens/s and MFU over logged steps after the first (compile) one,
    total seconds since the logger was created, and `logged_steps`: how many steps were logged
    (every config.metrics.log_every-th, so not the number of steps trained)."""
    losses = [r["loss"] for r in self._records if isinstance(r.get("loss"), float)]

    def mean_after_first(key: str) -> float | None:
      values = [r[key] for r in self._records[1:] if isinstance(r.get(key), float)]
      return float(np.mean(values)) if values else None

    return {"logged_steps": len(self._records),
            "last_step": self._records[-1]["step"] if self._records else None,
            "final_loss": losses[-1] if losses else None,
            "min_loss": float(np.nanmin(losses)) if losses and not np.all(np.isnan(losses)) else None,
            "mean_tokens_per_s": mean_after_first("tokens_per_s"),
            "mean_mfu": mean_after_first("mfu"),
            "total_seconds": time.perf_counter() - self._t0}

  def close(self) -> dict:
    """Ends the progress line, prints the summary (primary), closes the files; returns the summary."""
    result = self.summary()
    if self._closed:
      return result
    self._closed = True
    if self.primary:
      if self._tty and self._line_len:
        self._stream.write("\n")
      safe = {k: _json_safe(v) for k, v in result.items()}
      self._stream.write("summary: " + json.dumps(safe) + "\n")
      self._stream.flush()
      self._jsonl.close()
      if self._tb is not None:
        self._tb.close()
    return result

  def __enter__(self) -> "MetricsLogger":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
