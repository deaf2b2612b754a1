"""Benchmark: the cost of the nsjail sandbox on a trivial command.

Median wall time of `Sandbox.run("true")` (nsjail: namespaces, mounts, cgroups, seccomp, our
pipe reader) against a plain `subprocess.run(["bash", "-c", "true"])`, over N runs each,
interleaved so machine load hits both alike. Target: at most 50 ms of overhead per command.

    python -m experiments.bench.sandbox --runs=50

Prints a table and, as the last line, one JSON object with the overhead in ms and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from rl.sandbox import Sandbox


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=50)
  args = parser.parse_args()
  sandbox = Sandbox()
  with tempfile.TemporaryDirectory() as d:
    task_dir = Path(d)
    sandbox.run("true", task_dir)  # warm caches (the binary, the probe)
    plain, jailed = [], []
    for _ in range(args.runs):
      t0 = time.perf_counter()
      subprocess.run(["bash", "-c", "true"], check=True)
      plain.append(time.perf_counter() - t0)
      t0 = time.perf_counter()
      result = sandbox.run("true", task_dir)
      jailed.append(time.perf_counter() - t0)
      assert result.exit_code == 0, result
  rows = [("plain bash -c true", plain), (f"sandboxed ({sandbox.mode})", jailed)]
  print(f"{'command':<36} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8}")
  for name, times in rows:
    q = statistics.quantiles(times, n=10)
    print(f"{name:<36} {statistics.median(times) * 1e3:>10.1f} {q[0] * 1e3:>8.1f} {q[-1] * 1e3:>8.1f}")
  plain_ms, jailed_ms = statistics.median(plain) * 1e3, statistics.median(jailed) * 1e3
  print(json.dumps({"runs": args.runs, "mode": sandbox.mode, "plain_ms": round(plain_ms, 2),
                    "sandbox_ms": round(jailed_ms, 2), "overhead_ms": round(jailed_ms - plain_ms, 2),
                    "ratio": round(jailed_ms / plain_ms, 1), "target_overhead_ms": 50}))


if __name__ == "__main__":
  main()
