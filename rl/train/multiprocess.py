"""Multi-process RL (one process per host, `jax.distributed`): who plays what, and moving data.

The policy and optimizer live on the global mesh, sharded exactly as in pretraining, and the
update is one program over every process's devices. Rollouts are per process: each process
plays whole groups (a prompt's samples together, so advantages stay within a group) on its own
engine, which holds a whole copy of the policy on the process's first device (`local_copy`,
refreshed at every weight sync). The played episodes are then exchanged (`gather_objects`), so
every process holds the same batch in the same order as a one-process run would, and computes
the same rewards, advantages, micro-batches and metrics; `put_global` places a micro-batch's
rows on the mesh from that shared copy and `to_host` brings results back.

With one process each helper is the plain single-process operation.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from sharding import distributed


def my_groups(groups: int, process: int | None = None, processes: int | None = None) -> list[int]:
  """The group indices a process plays: every processes-th one, starting at its index."""
  process = jax.process_index() if process is None else process
  processes = jax.process_count() if processes is None else processes
  return list(range(process, groups, processes))


def gather_objects(objs: Sequence[Any]) -> list[list[Any]]:
  """Every process's list of picklable objects, in process order (all processes must call)."""
  if jax.process_count() == 1:
    return [list(objs)]
  # Processes finish their rollouts at different times. Wait on the barrier built at start-up
  # (sharding/distributed.py) first: gloo gives up on building a new communicator, as the
  # all-gathers below may need, when its members arrive more than 30 s apart.
  multihost_utils.sync_global_devices("rl_gather_objects")
  every = distributed.allgather_bytes(pickle.dumps(list(objs), protocol=pickle.HIGHEST_PROTOCOL))
  return [pickle.loads(b) for b in every]


def in_job_order(per_process: Sequence[Sequence[Any]], groups: int, group_size: int) -> list[Any]:
  """Reassembles what each process played (`my_groups`, group_size items per group) in the
  order of the whole job list."""
  out: list[Any] = [None] * (groups * group_size)
  for p, items in enumerate(per_process):
    mine = my_groups(groups, p, len(per_process))
    if len(items) != len(mine) * group_size:
      raise RuntimeError(f"process {p} returned {len(items)} episodes for {len(mine)} groups of "
                         f"{group_size}; the processes disagree on the step's jobs.")
    for i, item in enumerate(items):
      out[mine[i // group_size] * group_size + i % group_size] = item
  return out


def to_host(x: jax.Array) -> np.ndarray:
  """The whole value of a (possibly multi-process) array on this host."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(x)
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def put_global(x: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  """An array laid out by `sharding` from a host value every process holds in full."""
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def local_copy(model: nnx.Module) -> nnx.Module:
  """`model` itself with one process; else a whole copy of its state on this process's first
  local device (what that process's engine generates with)."""
  if jax.process_count() == 1:
    return model
  graphdef, state = nnx.split(model)
  device = jax.local_devices()[0]
  local = jax.tree.map(lambda a: jax.device_put(to_host(a), device), state)
  return nnx.merge(graphdef, local)


def engine_context() -> contextlib.AbstractContextManager:
  """Where a process's engine is built and fed: with several processes, outside the global mesh,
  so its caches and weights live on this process's device, not across every process's."""
  return jax.set_mesh(None) if jax.process_count() > 1 else contextlib.nullcontext()
