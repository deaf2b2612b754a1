"""One tolerance helper keyed by dtype (STYLE.md #6). Never loosen to pass."""

import numpy as np

# Relative tolerance on the Frobenius norm of the difference, per dtype.
_RTOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}


def rel_err(a, b) -> float:
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_close(actual, expected, dtype="float32", rtol=None, what=""):
  """Asserts ||actual - expected|| / ||expected|| <= rtol (default by dtype)."""
  actual = np.asarray(actual)
  expected = np.asarray(expected)
  assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
  assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
  tol = _RTOL[str(np.dtype(dtype))] if rtol is None else rtol
  err = rel_err(actual, expected)
  assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


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
