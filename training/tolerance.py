"""The one tolerance helper keyed by dtype (STYLE.md #6): do two computations of a function agree?

Used by the tests (through tests/helpers.py) and by benchmarks that must show
two layouts compute the same thing before comparing their speed
(experiments/bench/expert_parallel.py). Never loosen a tolerance to make a
check pass: a loosened tolerance is a bug report.
"""

from __future__ import annotations

import numpy as np

# Relative tolerance on the Frobenius norm of the difference, per dtype.
RTOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}


def rel_err(a, b) -> float:
  """||a - b|| / ||b|| (Frobenius, in float64; ||b|| floored at 1e-30)."""
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_close(actual, expected, dtype="float32", rtol=None, what=""):
  """Asserts ||actual - expected|| / ||expected|| <= rtol (default by dtype)."""
  actual = np.asarray(actual)
  expected = np.asarray(expected)
  assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
  assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
  tol = RTOL[str(np.dtype(dtype))] if rtol is None else rtol
  err = rel_err(actual, expected)
  assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"
