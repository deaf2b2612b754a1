"""Measurement helpers shared by the benchmarks."""

import statistics
import time

import jax


def compiled_peak_bytes(compiled) -> int:
  """Planned device bytes of a compiled program: temporaries + arguments + outputs."""
  m = compiled.memory_analysis()
  return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)


def median_seconds(compiled, args, reps: int, warmup: bool = True) -> float:
  """Median wall time of `reps` calls of a compiled program (blocking on results)."""
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
