"""sharding/distributed.py's decisions, which a mutation audit found unpinned: when 'auto' starts
jax.distributed and when it does not, what 'on' and 'off' do, the process-id range's ends, an empty
environment variable, local device ids, and what reaches jax.distributed.initialize (and the barrier
built right after). jax.distributed is replaced by a recorder: nothing connects anywhere."""

import types

import pytest

from sharding import distributed


@pytest.fixture
def started(monkeypatch):
  """The calls initialize makes into jax (config updates, initialize, the start-up barrier)."""
  calls = []
  fake = types.SimpleNamespace(
      config=types.SimpleNamespace(update=lambda k, v: calls.append(("config", k, v))),
      distributed=types.SimpleNamespace(initialize=lambda **kw: calls.append(("initialize", kw))),
      process_index=lambda: 0, process_count=lambda: 1, local_device_count=lambda: 1, device_count=lambda: 1)
  monkeypatch.setattr(distributed, "jax", fake)
  monkeypatch.setattr(distributed, "multihost_utils",
                      types.SimpleNamespace(sync_global_devices=lambda name: calls.append(("sync", name))))
  return calls


def test_auto_passes_the_settings_and_builds_the_barrier(started):
  assert distributed.initialize("auto", coordinator_address="h0:1234", num_processes=2, process_id=0,
                                local_device_ids="3,1", env={}) is True
  assert started == [("config", "jax_cpu_collectives_implementation", "gloo"),
                     ("initialize", {"coordinator_address": "h0:1234", "num_processes": 2, "process_id": 0,
                                     "local_device_ids": [3, 1]}),
                     ("sync", "horizon_distributed_start")]


def test_process_id_bounds_are_zero_and_num_processes_minus_one(started):
  """[0, n): the first and last ids start; -1 and n are refused before anything starts."""
  for pid in (0, 2):
    assert distributed.initialize("auto", coordinator_address="h:1", num_processes=3, process_id=pid, env={})
  assert [c[1]["process_id"] for c in started if c[0] == "initialize"] == [0, 2]
  started.clear()
  for pid in (-1, 3):
    with pytest.raises(ValueError, match=rf"--process_id={pid} must be in \[0, --num_processes=3\)"):
      distributed.initialize("auto", coordinator_address="h:1", num_processes=3, process_id=pid, env={})
  assert started == []


def test_auto_stays_single_for_one_process_and_off_never_starts(started):
  assert distributed.initialize("auto", num_processes=1, env={}) is False
  assert distributed.initialize("auto", env={"JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"}) is False
  off = distributed.initialize("off", coordinator_address="h:1", num_processes=2, process_id=1, env={})
  assert off is False
  assert started == []


def test_no_processes_or_a_lone_process_id_is_refused(started):
  """A process count below 1 is refused in every mode (it ran as one process); a non-zero process
  id with no multi-process run is refused in 'auto' (it was ignored: a launch missing its
  coordinator ran as process 0 of 1). Process id 0 alone is the single-process run."""
  for mode in distributed.MODES:
    with pytest.raises(ValueError, match=r"--num_processes=0 \(or JAX_NUM_PROCESSES\) must be at least 1"):
      distributed.initialize(mode, num_processes=0, env={})
  with pytest.raises(ValueError, match="--num_processes=-2"):
    distributed.initialize("auto", env={"JAX_NUM_PROCESSES": "-2"})
  for kw in ({"process_id": 1}, {"env": {"JAX_PROCESS_ID": "3"}}, {"process_id": 1, "num_processes": 1}):
    with pytest.raises(ValueError, match=r"--process_id=\d \(or JAX_PROCESS_ID\) without a multi-process"):
      distributed.initialize("auto", **{"env": {}, **kw})
  assert distributed.initialize("auto", process_id=0, env={}) is False
  assert started == []


def test_a_coordinator_alone_means_many_processes(started):
  """A coordinator makes the run multi-process even without a count: the missing ones are named."""
  with pytest.raises(ValueError, match=r"missing \['num_processes', 'process_id'\]"):
    distributed.initialize("auto", coordinator_address="h:1", env={})
  with pytest.raises(ValueError, match=r"missing \['process_id'\]"):
    distributed.initialize("on", env={"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"})
  assert started == []


def test_on_without_addresses_lets_jax_discover_them(started):
  """TPU pods, SLURM, Open MPI: initialize() with no arguments, then the barrier."""
  assert distributed.initialize("on", env={}) is True
  assert started[1:] == [("initialize", {}), ("sync", "horizon_distributed_start")]


def test_the_environment_fills_what_is_not_given():
  env = {"JAX_COORDINATOR_ADDRESS": "h0:9", "JAX_NUM_PROCESSES": "", "JAX_PROCESS_ID": "1",
         "JAX_LOCAL_DEVICE_IDS": "2"}
  # An empty variable (`JAX_NUM_PROCESSES= cmd`) is unset, not an error.
  assert distributed.settings(env=env) == {"coordinator_address": "h0:9", "num_processes": None,
                                           "process_id": 1, "local_device_ids": [2]}
  assert distributed.settings(num_processes=4, local_device_ids=(5, 6), env=env)["num_processes"] == 4
  # An argument wins even when it is 0 (`or` would read 0 as unset and take the environment's 3).
  assert distributed.settings(num_processes=0, env={"JAX_NUM_PROCESSES": "3"})["num_processes"] == 0
  assert distributed.settings(local_device_ids=(5, 6), env=env)["local_device_ids"] == [5, 6]
  with pytest.raises(ValueError, match="JAX_PROCESS_ID='1.0' must be an integer"):
    distributed.settings(env={"JAX_PROCESS_ID": "1.0"})


@pytest.mark.parametrize("ids", ["0,1,", "0;1", "gpu0"])
def test_bad_local_device_ids_name_the_setting(ids):
  """These failed with int()'s bare "invalid literal for int() with base 10: ''"."""
  named = rf"local device ids '{ids}' \(--local_device_ids or JAX_LOCAL_DEVICE_IDS\)"
  with pytest.raises(ValueError, match=named):
    distributed.settings(env={"JAX_LOCAL_DEVICE_IDS": ids})
  with pytest.raises(ValueError, match=rf"local device ids '{ids}' .* must be a comma list of integers"):
    distributed.settings(local_device_ids=ids, env={})
