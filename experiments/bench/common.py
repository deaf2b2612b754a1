"""Measurement helpers shared by the benchmarks."""

import argparse
import os
import statistics
import time

import jax
from absl import flags

from training import metrics

# Instruction-set flags that decide a CPU's bf16 and f32 matmul peaks.
_PEAK_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def parse_cpuinfo(text: str) -> dict:
  """The first processor's identity in a /proc/cpuinfo text (x86 field names).

  Returns model name, vendor, family and model (which tell CPU generations apart when the
  model name is generic, as on cloud VMs: AMD family 25 is Zen 3/4, 26 is Zen 5) and which of
  the flags that set the matmul peak it has.
  """
  fields: dict[str, str] = {}
  for line in text.splitlines():
    if not line.strip():
      if fields:
        break  # the end of the first processor's block
      continue
    key, _, value = line.partition(":")
    fields.setdefault(key.strip(), value.strip())
  flags = set(fields.get("flags", "").split())
  out = {"model_name": fields.get("model name", ""), "vendor": fields.get("vendor_id", ""),
         "family": fields.get("cpu family", ""), "model": fields.get("model", "")}
  out["peak_flags"] = [f for f in _PEAK_FLAGS if f in flags]
  return out


def cpu_identity() -> dict:
  """This machine's CPU (`parse_cpuinfo`) and the cores this process may use; {} off Linux.

  Benchmarks print it beside a measured peak, so numbers from different machines are not
  compared as if they came from one.
  """
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      out = parse_cpuinfo(f.read())
  except OSError:
    return {}
  out["cores"] = len(os.sched_getaffinity(0))
  return out


def describe_cpu(identity: dict) -> str:
  """One line for a benchmark's header: 'AMD EPYC (AuthenticAMD family 25 model 17), 2 cores, ...'."""
  if not identity:
    return "cpu: unknown (no /proc/cpuinfo)"
  return (f"cpu: {identity['model_name']} ({identity['vendor']} family {identity['family']} model "
          f"{identity['model']}), {identity['cores']} cores, flags {' '.join(identity['peak_flags']) or '-'}")


def report_cpu() -> dict:
  """Prints `describe_cpu` of this machine when the benchmark runs on the CPU backend; returns the
  identity for the benchmark's JSON ({} on another backend or off Linux)."""
  cpu = cpu_identity() if jax.default_backend() == "cpu" else {}
  if cpu:
    print(describe_cpu(cpu))
  return cpu


def compiled_peak_bytes(compiled) -> int:
  """Planned device bytes of a compiled program: temporaries + arguments + outputs."""
  m = compiled.memory_analysis()
  return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)


def median_seconds(compiled, args, reps: int, warmup: bool = True) -> float:
  """Median wall time of `reps` calls of a compiled program (blocking on results)."""
  if reps < 1:
    raise ValueError(f"median_seconds: reps={reps} must be >= 1 (--reps)")
  if warmup:
    jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def skip_message(peak_bytes: int, limit_bytes: float) -> str | None:
  """'skipped: needs X GiB' when a compiled program's planned bytes exceed the limit, else None.

  Benchmarks compile first (`compiled_peak_bytes`) and only run what fits.
  """
  if peak_bytes > limit_bytes:
    return f"skipped: needs {peak_bytes / 2 ** 30:.1f} GiB"
  return None


def best_peak_flops(sizes: list[int], reps: int, dtype: str = "bfloat16") -> tuple[float, int]:
  """The highest matmul FLOP/s over square sizes (`metrics.measure_peak_flops`) and its size.

  A peak is the best the hardware reaches, and the best size differs between machines (on a
  2-core AMD EPYC, bf16 n=1024 reached 440 GFLOP/s and n=2048 397).
  """
  if not sizes:
    raise ValueError("best_peak_flops: sizes is empty; give at least one matmul size.")
  return max((metrics.measure_peak_flops(n, reps, dtype=dtype), n) for n in sizes)


def positive_int(text: str) -> int:
  """argparse type for counts such as --reps: an int >= 1 (0 timed runs had no median: a
  StatisticsError after the compile)."""
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"{text!r}: give an int >= 1")
  return value


def matmul_sizes(text: str) -> list[int]:
  """argparse type for --peak_n: '1024,2048' -> [1024, 2048]; anything else is a clear error."""
  try:
    sizes = [int(x) for x in text.split(",")]
  except ValueError:
    sizes = []
  if not sizes or min(sizes) < 1:
    raise argparse.ArgumentTypeError(f"{text!r}: give positive matmul sizes, comma-separated (1024,2048)")
  return sizes


def quick_flag(help_text: str):
  """The benchmarks' --quick (a smoke run), defined once per process: absl refuses a second
  definition, and the tests import several benchmark modules into one process. Returns an object
  whose `.value` is the flag's value."""
  if "quick" in flags.FLAGS:
    return flags.FLAGS["quick"]
  return flags.DEFINE_bool("quick", False, help_text)
