"""Multi-process (multi-host) start-up: `jax.distributed.initialize` from flags or the environment.

Each setting falls back to an environment variable when not given:

  coordinator_address  JAX_COORDINATOR_ADDRESS  host:port of process 0
  num_processes        JAX_NUM_PROCESSES
  process_id           JAX_PROCESS_ID
  local_device_ids     JAX_LOCAL_DEVICE_IDS     comma list (GPU: one process per GPU)

mode 'auto' initialises when a coordinator or more than one process is given;
'on' without addresses lets `jax.distributed.initialize()` discover them (TPU
pods, SLURM, Open MPI); 'off' never initialises. On CPU, cross-process
collectives go over gloo. Must run before anything touches a JAX device.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

MODES = ("auto", "on", "off")


def _env_int(env: Mapping[str, str], name: str) -> int | None:
  value = env.get(name)
  if value in (None, ""):
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"environment variable {name}={value!r} must be an integer.") from None


def settings(coordinator_address: str | None = None, num_processes: int | None = None,
             process_id: int | None = None, local_device_ids: str | Sequence[int] | None = None,
             env: Mapping[str, str] | None = None) -> dict:
  """The resolved coordinator / process count / process id / local devices (arguments over `env`).

  Args:
    coordinator_address: host:port of process 0, or None for JAX_COORDINATOR_ADDRESS.
    num_processes: or None for JAX_NUM_PROCESSES.
    process_id: or None for JAX_PROCESS_ID.
    local_device_ids: a comma list ("0,1") or ints, or None for JAX_LOCAL_DEVICE_IDS.
    env: the environment (default: os.environ).
  """
  env = os.environ if env is None else env
  local = local_device_ids or env.get("JAX_LOCAL_DEVICE_IDS")
  if isinstance(local, str):
    try:
      local = [int(i) for i in local.split(",")]
    except ValueError:
      raise ValueError(f"local device ids {local!r} (--local_device_ids or JAX_LOCAL_DEVICE_IDS) must be a "
                       "comma list of integers, e.g. '0,1'.") from None
  return {
      "coordinator_address": coordinator_address or env.get("JAX_COORDINATOR_ADDRESS"),
      "num_processes": num_processes if num_processes is not None else _env_int(env, "JAX_NUM_PROCESSES"),
      "process_id": process_id if process_id is not None else _env_int(env, "JAX_PROCESS_ID"),
      "local_device_ids": list(local) if local else None,
  }


def initialize(mode: str = "auto", **flags) -> bool:
  """Initialises jax.distributed per `mode` and `settings(**flags)`; returns whether it did.

  Raises:
    ValueError: an unknown mode, a process count below 1, a non-zero process id without a
      multi-process run ('auto'), or a multi-process run missing its coordinator, process count or
      process id, or a process id outside [0, num_processes).
  """
  if mode not in MODES:
    raise ValueError(f"--distributed={mode!r}: choose one of {MODES}.")
  s = settings(**flags)
  if s["num_processes"] is not None and s["num_processes"] < 1:
    raise ValueError(f"--num_processes={s['num_processes']} (or JAX_NUM_PROCESSES) must be at least 1.")
  if mode == "off":
    return False
  multi = s["coordinator_address"] is not None or (s["num_processes"] or 1) > 1
  if mode == "auto" and not multi:
    if s["process_id"] not in (None, 0):
      raise ValueError(f"--process_id={s['process_id']} (or JAX_PROCESS_ID) without a multi-process run: "
                       "give --coordinator_address and --num_processes too, or drop it.")
    return False
  if multi:
    missing = [k for k in ("coordinator_address", "num_processes", "process_id") if s[k] is None]
    if missing:
      raise ValueError(f"multi-process run: missing {missing}; pass --coordinator_address, "
                       "--num_processes and --process_id (or JAX_COORDINATOR_ADDRESS, "
                       "JAX_NUM_PROCESSES, JAX_PROCESS_ID).")
    if not 0 <= s["process_id"] < s["num_processes"]:
      raise ValueError(f"--process_id={s['process_id']} must be in [0, --num_processes="
                       f"{s['num_processes']}).")
  # CPU devices talk over gloo (no effect on TPU/GPU devices' collectives).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(**{k: v for k, v in s.items() if v is not None})
  # Gloo (CPU) builds each communicator on its first use and gives up when the processes arrive
  # more than 30 s apart. Build the one-device-per-process communicator that every barrier uses
  # (process 0 preparing data, orbax's checkpoint syncs) now, while the processes have just met:
  # once built, a barrier waits as long as it must (tests/test_multihost.py: 40 s).
  multihost_utils.sync_global_devices("horizon_distributed_start")
  logging.info("jax.distributed: process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())
  return True


def allgather_bytes(data: bytes) -> list[bytes]:
  """Every process's `data`, in process order; all processes must call it.

  Byte strings of any (differing) lengths: the sizes are gathered first and each string is
  padded to the longest. One process: [data].
  """
  if jax.process_count() == 1:
    return [data]
  buf = np.frombuffer(data, np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.asarray([buf.size], np.int64)))
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:buf.size] = buf
  every = np.asarray(multihost_utils.process_allgather(padded))
  return [every[p, :int(sizes[p, 0])].tobytes() for p in range(every.shape[0])]
