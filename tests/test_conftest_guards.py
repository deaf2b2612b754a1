"""The suite's guards (tests/conftest.py): a hung test ends its process with every thread's stack
instead of holding CI, child JAX processes share the parent's machine-keyed compile cache, and CI
fails the sandbox tests that would otherwise skip (tests/helpers.py: isolation_unavailable)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import compile_cache_dir, compile_cache_env, isolation_unavailable

ROOT = Path(__file__).resolve().parents[1]


def test_hung_test_dumps_stacks_and_exits(tmp_path):
  (tmp_path / "test_hang.py").write_text(
      "import time\n\ndef test_sleeps_forever():\n  time.sleep(600)\n\ndef test_after():\n  pass\n")
  env = dict(os.environ, HORIZON_HANG_LIMIT_S="3")
  t0 = time.time()
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
         str(tmp_path / "test_hang.py")]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert time.time() - t0 < 120
  assert proc.returncode != 0
  out = proc.stdout + proc.stderr
  assert "Timeout (0:00:03)!" in out, out[-2000:]
  assert "in test_sleeps_forever" in out  # the hung test's stack
  assert "passed" not in out  # the process ended there


def test_child_cache_env_matches_parent():
  env = compile_cache_env()
  assert env["JAX_COMPILATION_CACHE_DIR"] == compile_cache_dir()
  assert int(env["JAX_COMPILATION_CACHE_MAX_SIZE"]) > 0
  import jaxlib
  assert os.path.basename(compile_cache_dir()).startswith(f"jaxlib-{jaxlib.__version__}-cpu-")


@pytest.mark.parametrize("value, outcome", [("1", pytest.fail.Exception), ("", pytest.skip.Exception),
                                            ("0", pytest.skip.Exception)])
def test_missing_isolation_skips_but_fails_where_ci_requires_it(monkeypatch, value, outcome):
  monkeypatch.setenv("HORIZON_REQUIRE_ISOLATION", value)
  with pytest.raises(outcome, match="nsjail cannot run here: no user namespaces"):
    isolation_unavailable("nsjail cannot run here: no user namespaces")


def test_ci_requires_isolation():
  assert "export HORIZON_REQUIRE_ISOLATION=1\n" in (ROOT / ".ci" / "run").read_text()
