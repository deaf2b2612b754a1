"""Sandboxes shared by the sandbox tests (module-scoped: each test file builds its own; nsjail's probe
is cached per process)."""

import pytest

from rl.sandbox import Sandbox, SandboxUnavailable
from tests.helpers import isolation_unavailable


@pytest.fixture(scope="module")
def small():
  """nsjail with small limits (128 MB, 32 pids, 1000 output bytes, 5 s, 1 MB /tmp and files)."""
  try:
    return Sandbox(memory_mb=128, max_pids=32, output_limit_bytes=1000, timeout_s=5.0, tmp_mb=1,
                   file_size_mb=1)
  except SandboxUnavailable as e:
    isolation_unavailable(f"nsjail cannot run here: {e}")


@pytest.fixture(scope="module")
def unsafe():
  """The unsafe back end (no nsjail binary, allow_unsafe) with the same output and file caps."""
  with pytest.warns(RuntimeWarning, match="SANDBOX DISABLED"):
    return Sandbox(nsjail="/nonexistent/nsjail", allow_unsafe=True, output_limit_bytes=1000, file_size_mb=1)
