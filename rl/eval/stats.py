"""Statistics for evaluation tables: Wilson intervals, unbiased pass@k, percentiles.

Wilson score interval (Wilson, 1927): better coverage than the normal approximation at small
n and near 0 or 1, where small-model evaluations live. pass@k: the unbiased estimator of
Chen et al. 2021 (Codex), 1 - C(n - c, k) / C(n, k) for n samples of which c pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Z95 = 1.959963984540054


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
  """The Wilson score interval of a binomial proportion; (0, 1) when n = 0."""
  if n <= 0:
    return 0.0, 1.0
  p = successes / n
  denom = 1 + z * z / n
  centre = (p + z * z / (2 * n)) / denom
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
  lo, hi = max(0.0, centre - half), min(1.0, centre + half)
  # exact at the ends (p = 0 gives lo = 0, p = 1 gives hi = 1; rounding must not move them)
  return (0.0 if successes == 0 else lo), (1.0 if successes == n else hi)


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k from n samples with c correct (k <= n)."""
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  # 1 - prod_{i=n-c+1}^{n} (1 - k / i), numerically stable
  return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def percentile(values: Sequence[float], q: float) -> float:
  """Linear-interpolated percentile (q in [0, 100]); nan for no values."""
  if not values:
    return float("nan")
  xs = sorted(values)
  pos = (len(xs) - 1) * q / 100.0
  lo, hi = math.floor(pos), math.ceil(pos)
  return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
