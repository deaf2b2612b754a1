"""Test helpers: the one tolerance helper keyed by dtype (STYLE.md #6, in training/tolerance.py so
benchmarks share it; never loosen to pass) and the environment of a test's child JAX process."""

from training.tolerance import RTOL, assert_close, rel_err

__all__ = ["RTOL", "assert_close", "rel_err", "subprocess_env"]


def subprocess_env(devices: int) -> dict:
  """Environment for a test's child JAX process: CPU with `devices` devices, the suite's compile cache.

  Children that compile the same programs (a run, its killed twin, its resume)
  then compile once per suite run.
  """
  import os
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  env["JAX_COMPILATION_CACHE_DIR"] = os.environ.get("HORIZON_JAX_CACHE", "/tmp/horizon_jax_cache")
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(k, None)
  return env
