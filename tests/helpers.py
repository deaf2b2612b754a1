"""Test helpers: the one tolerance helper keyed by dtype (STYLE.md #6, in training/tolerance.py so
benchmarks share it; never loosen to pass), the environment of a test's child JAX process, a
stand-in for the engine driving a token processor, and random inputs with packed segments."""

import os
from typing import NoReturn

import jax.numpy as jnp
import numpy as np
import pytest

from training.tolerance import RTOL, assert_close, rel_err

__all__ = ["RTOL", "assert_close", "child_xla_flags", "compile_cache_env", "drive_processor",
           "isolation_unavailable", "kill_once_saved", "model_like", "normal_data", "packed_segments",
           "rel_err", "row_positions", "segment_positions", "subprocess_env", "text_tokens"]

# The persistent compile cache's size cap: jax evicts least-recently-used entries past it (under a
# file lock shared by the processes using the folder), so /tmp does not grow run after run.
CACHE_MAX_BYTES = 8 << 30


def compile_cache_dir() -> str:
  """The persistent compile cache of the tests' child processes: $HORIZON_JAX_CACHE (default
  /tmp/horizon_jax_cache), one sub-folder per jaxlib version and CPU model + feature flags.

  jax keys an entry by program, jaxlib, XLA flags and device kind ("cpu"), not by the host's
  instruction set, and an XLA:CPU executable written on another CPU model fails the loader's
  machine check. The test processes themselves use no persistent cache (tests/conftest.py): a
  worker aborted in `deserialize_executable` in four suite runs over two sessions (test_overfit,
  test_train_step, test_bench_prefix_cache; on this machine too, so not only another CPU's
  entries), and the cause is not found.
  """
  import hashlib
  import os

  import jaxlib
  base = os.environ.get("HORIZON_JAX_CACHE", "/tmp/horizon_jax_cache")
  cpu = ""
  try:
    with open("/proc/cpuinfo") as f:
      cpu = "".join(sorted({line for line in f if line.startswith(("model name", "flags"))}))
  except OSError:
    import platform
    cpu = platform.processor() + platform.machine()
  key = hashlib.sha256(cpu.encode()).hexdigest()[:12]
  return os.path.join(base, f"jaxlib-{jaxlib.__version__}-cpu-{key}")


def compile_cache_env() -> dict:
  """The environment variables that give a child JAX process the suite's compile cache."""
  return {"JAX_COMPILATION_CACHE_DIR": compile_cache_dir(),
          "JAX_COMPILATION_CACHE_MAX_SIZE": str(CACHE_MAX_BYTES),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"}


def child_xla_flags(devices: int) -> str:
  """A child JAX process's XLA_FLAGS: the test process's own (tests/conftest.py: its backend
  optimisation level), with `devices` fake CPU devices. A child compiles as its test process does,
  so values computed on both sides (a checkpoint's random weights, a reference loss) agree bit for
  bit: jax.random.normal's bits depend on the level."""
  import os
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  return " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])


def subprocess_env(devices: int) -> dict:
  """Environment for a test's child JAX process: CPU with `devices` devices, the suite's compile cache.

  Children that compile the same programs (a run, its killed twin, its resume)
  then compile once per suite run.
  """
  import os
  env = dict(os.environ)
  env["XLA_FLAGS"] = child_xla_flags(devices)
  env["JAX_PLATFORMS"] = "cpu"
  env.update(compile_cache_env())
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(k, None)
  return env


def kill_once_saved(proc, checkpoint_dir, timeout_s: float = 600.0, after_s: float = 0.0) -> None:
  """SIGKILLs a launcher process once `checkpoint_dir` exists (orbax renames its tmp dir on
  commit), `after_s` seconds later; fails if the process ends or the time runs out first."""
  import os
  import signal
  import time
  deadline = time.time() + timeout_s
  while not checkpoint_dir.is_dir():
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    assert time.time() < deadline, f"no {checkpoint_dir} after {timeout_s} s"
    time.sleep(0.02)
  time.sleep(after_s)
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()


def drive_processor(proc, rng, free_ids, max_steps: int = 400, stop_id: int | None = None):
  """Plays the engine for a TokenProcessor: forced ids are fed, masks sampled from (with the
  seeded `rng`), free steps take `free_ids` in order. stop_id: a token the engine stops on
  without feeding it (the end of turn). Returns (all deltas, finish reason or None)."""
  deltas, reason, free = [], None, iter(free_ids)
  for _ in range(max_steps):
    c = proc.next_constraint()
    if c is None:
      token = next(free)
    elif isinstance(c, (int, np.integer)):
      token = int(c)
    else:
      token = int(rng.choice(np.flatnonzero(c)))
    if token == stop_id:
      return deltas + proc.close("stop"), "stop"
    out, reason = proc.feed(token)
    deltas += out
    if reason is not None:
      break
  return deltas + proc.close(reason or "length"), reason


def model_like(model, cfg):
  """A model of config `cfg` holding `model`'s variables (no new init): the same weights under
  another remat / dtype / scan setting."""
  from flax import nnx

  from model.decoder import abstract_model
  m = abstract_model(cfg)
  nnx.update(m, nnx.state(model))
  return m


def text_tokens(cfg, shape, seed=0):
  """Random int32 token ids below the image placeholder id (text only)."""
  import jax.numpy as jnp
  return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.image_token_id, shape), jnp.int32)


def normal_data(seed, shape):
  """Random f32 normal data (numpy: no compile per shape)."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def packed_segments(b, t, cuts):
  """[b, t] segment ids: row r changes segment at each position in cuts[r]."""
  seg = np.zeros((b, t), np.int32)
  for r, cs in enumerate(cuts):
    for c in cs:
      seg[r, c:] += 1
  return jnp.asarray(seg)


def segment_positions(seg):
  """Positions that restart at 0 at every segment start (packed sequences)."""
  seg = np.asarray(seg)
  pos = np.zeros(seg.shape, np.int32)
  for i in range(1, seg.shape[1]):
    pos[:, i] = np.where(seg[:, i] == seg[:, i - 1], pos[:, i - 1] + 1, 0)
  return jnp.asarray(pos)


def row_positions(b, t):
  """Positions 0..t-1 in each of b rows."""
  return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


REQUIRE_ISOLATION = "HORIZON_REQUIRE_ISOLATION"


def isolation_unavailable(reason: str) -> NoReturn:
  """Skips a test that needs nsjail or a tmpfs mount (root on Linux) where this machine lacks it;
  fails it where $HORIZON_REQUIRE_ISOLATION is 1 (.ci/run sets it), so a broken sandbox cannot
  pass CI as skips."""
  if os.environ.get(REQUIRE_ISOLATION) == "1":
    pytest.fail(f"{reason} (and ${REQUIRE_ISOLATION}=1 requires it)")
  pytest.skip(reason)


def failing_session(inner):
  """A policy session that behaves as `inner` except that every turn fails as a server that is down
  (ConnectionError): an episode the policy could not play."""

  class Failing:
    token_level = False

    def __getattr__(self, name):
      return getattr(inner, name)

    async def complete(self, messages, turn):
      raise ConnectionError("connection refused")

  return Failing()
