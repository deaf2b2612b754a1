"""Multi-process (multi-host) start-up shared by the launchers.

Flags, each with the environment variable it falls back to:

  --coordinator_address  JAX_COORDINATOR_ADDRESS  host:port of process 0
  --num_processes        JAX_NUM_PROCESSES
  --process_id           JAX_PROCESS_ID
  --local_device_ids     JAX_LOCAL_DEVICE_IDS     comma list (GPU: one process per GPU)
  --distributed          auto | on | off

'auto' initialises when a coordinator or more than one process is given, and
'on' without addresses lets `jax.distributed.initialize()` discover them (TPU
pods, SLURM, Open MPI). On CPU, cross-process collectives go over gloo. Must
run before anything touches a JAX device.
"""

from __future__ import annotations

import os

import jax
from absl import flags, logging

_COORD = flags.DEFINE_string("coordinator_address", None,
                             "host:port of process 0 (env JAX_COORDINATOR_ADDRESS).")
_NPROC = flags.DEFINE_integer("num_processes", None, "Number of processes (env JAX_NUM_PROCESSES).")
_PID = flags.DEFINE_integer("process_id", None, "This process's id (env JAX_PROCESS_ID).")
_LOCAL = flags.DEFINE_string("local_device_ids", None,
                             "Comma list of local device ids (env JAX_LOCAL_DEVICE_IDS).")
_MODE = flags.DEFINE_enum("distributed", "auto", ["auto", "on", "off"],
                          "Call jax.distributed.initialize: auto (when addresses are given), on, off.")


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  if value in (None, ""):
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"environment variable {name}={value!r} must be an integer.") from None


def settings() -> dict:
  """The resolved coordinator / process count / process id (flags over environment)."""
  local = _LOCAL.value or os.environ.get("JAX_LOCAL_DEVICE_IDS")
  return {
      "coordinator_address": _COORD.value or os.environ.get("JAX_COORDINATOR_ADDRESS"),
      "num_processes": _NPROC.value if _NPROC.value is not None else _env_int("JAX_NUM_PROCESSES"),
      "process_id": _PID.value if _PID.value is not None else _env_int("JAX_PROCESS_ID"),
      "local_device_ids": [int(i) for i in local.split(",")] if local else None,
  }


def initialize() -> bool:
  """Initialises jax.distributed per the flags; returns whether it did."""
  s = settings()
  mode = _MODE.value
  if mode == "off":
    return False
  multi = s["coordinator_address"] is not None or (s["num_processes"] or 1) > 1
  if mode == "auto" and not multi:
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
  logging.info("jax.distributed: process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())
  return True
