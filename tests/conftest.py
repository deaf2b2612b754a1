"""Test set-up: 8 fake CPU devices and XLA's optimisation level, set before JAX is imported anywhere."""

import gc
import os

# The test processes compile at XLA's backend (LLVM) optimisation level 0: the suite mostly compiles
# tiny programs, and level 0 cut its CPU time 44 -> 26 min (default suite, this machine). It changes
# code generation, not the HLO XLA optimises and fuses, so every numerics test still compares the
# same maths against its reference (last bits move: jax.random.normal's among them). The processes
# tests launch compile the same way (tests/helpers.child_xla_flags), so values computed on both sides
# agree bit for bit; test_quickstart runs the README's quickstart at XLA's default level, as a user
# does. HORIZON_TEST_XLA_OPT_LEVEL=default (or another level) changes it for the whole run.
_OPT = os.environ.get("HORIZON_TEST_XLA_OPT_LEVEL", "0")
_FLAGS = [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
os.environ["XLA_FLAGS"] = " ".join(_FLAGS + ([] if _OPT == "default" else
                                             [f"--xla_backend_optimization_level={_OPT}"])).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# No persistent compile cache in the test processes themselves: deserialising cached XLA:CPU
# executables there aborted an xdist worker now and then (jax 0.10.2; four runs over two sessions,
# in different tests, never reproduced alone; see tests/helpers.compile_cache_dir). Those aborts
# fit the memory-map limit found later (_release_compiled_programs below: loading an executable
# maps it just as compiling does), but the cache has not been turned back on and retried. The child
# processes tests launch (a run, its killed twin, its resume) still share one
# (tests/helpers.subprocess_env). pyproject's --max-worker-restart=0 ends a run whose worker
# crashed instead of letting --dist loadfile wait forever for the replacement (pytest-xdist 3.8).

# A test that hangs dumps every thread's stack and ends its process (xdist reports the worker's
# test as failed and goes on) instead of holding CI until its limit. $HORIZON_HANG_LIMIT_S overrides.
HANG_LIMIT_S = {"default": 900, "slow": 1800}


_hang_report = []  # a copy of the real stderr, taken before output capture starts per test


def pytest_configure(config):
  _hang_report.append(os.fdopen(os.dup(2), "w"))


def pytest_unconfigure(config):
  while _hang_report:  # (left open, it was an "unclosed file" ResourceWarning at exit)
    _hang_report.pop().close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  import faulthandler
  limit = float(os.environ.get("HORIZON_HANG_LIMIT_S", 0)) or \
      HANG_LIMIT_S["slow" if item.get_closest_marker("slow") else "default"]
  faulthandler.dump_traceback_later(limit, exit=True, file=_hang_report[0])
  try:
    yield
  finally:
    faulthandler.cancel_dump_traceback_later()


def _memory_maps() -> int:
  with open("/proc/self/maps") as f:
    return sum(1 for _ in f)


def _max_map_count() -> int:
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except OSError:  # a container without /proc/sys: the kernel's default
    return 65530


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
  """Drops JAX's cached compiled programs after a test file once they hold a quarter of the map limit.

  XLA:CPU maps each loaded executable's code and data into the process (six to ten memory maps
  per executable), and JAX's caches keep every program a jit ever compiled while its function
  lives. Without this, an xdist worker running half the suite climbed to 64,413 maps, next to the
  kernel's vm.max_map_count (65,530 by default). There the next compile logs "LLVM compilation
  error: Cannot allocate memory" and the process dies of SIGSEGV in backend_compile_and_load, in
  whichever test happens to be compiling: five suite runs lost a worker there, in four different
  tests. Clearing unmaps them. Clearing after every file instead cost the suite ~3 minutes
  (22:58 vs 19:31-19:50): fixtures that span files, such as the session's engine, recompile.
  """
  yield
  if not os.path.exists("/proc/self/maps"):
    return
  limit = _max_map_count()
  if _memory_maps() <= limit // 4:  # clearing after every file peaked at 17,599: one file's worth
    return
  jax.clear_caches()
  gc.collect()
  maps = _memory_maps()
  if maps > limit // 2:  # a clear error now, not a SIGSEGV some tests later
    raise RuntimeError(f"this test process holds {maps} memory maps after clearing JAX's caches "
                       f"(vm.max_map_count is {limit}): something in this file keeps compiled "
                       f"programs alive (a module-level jax.stages.Compiled, or a fixture)")


@pytest.fixture(scope="session")
def tiny_cfg():
  """The `tiny` ModelConfig (f32), shared by the whole session."""
  from configs import horizon
  from model.config import ModelConfig
  return ModelConfig.from_config(horizon.get_config("tiny").model)


# ---- serving (issue 5): one engine and one server per session, shared by the API tests ----


@pytest.fixture(scope="session")
def serve_config():
  """configs/serve.py:tiny with 4 slots and the API key "test-key"."""
  from configs import serve
  config = serve.get_config("tiny")
  config.serving.slots = 4
  config.serving.api_key = "test-key"
  return config


@pytest.fixture(scope="session")
def engine(serve_config):
  """A started Engine on the randomly initialised tiny model; stopped at session end."""
  from serving.build import build_engine
  eng = build_engine(serve_config).start()
  yield eng
  eng.stop()


@pytest.fixture(scope="session")
def server_url(engine, serve_config):
  """The server (create_app) on 127.0.0.1 at a free port, uvicorn in a daemon thread, warmed up
  (/health is 200), so a test that runs first sees the same server as one that runs later."""
  from serving.server import BackgroundServer, create_app
  server = BackgroundServer(create_app(engine, engine.tokenizer, serve_config)).start().wait_ready()
  yield server.url
  server.stop()
