"""Subprocess side of tests/test_checkpoint.py: saves killed mid-way, two-process saves.

    python -m tests._checkpoint_child kill <dir> write|commit
    python -m tests._checkpoint_child multihost <dir> <coordinator> <process_id>

`kill` saves step 1 and waits for it, then starts saving step 2 with orbax
patched to stop mid-save, prints READY and sleeps until the parent SIGKILLs
it. `write`: the 'meta' file of step 2 is half written (truncated JSON) when
the process dies; `commit`: every item of step 2 is written but the commit
(rename / commit_success.txt) has not happened. Either way step 2 must not
count as a checkpoint.

`multihost` runs as one of two processes (2 CPU devices each) saving a model
split over all 4 devices with a different data state per process, then
restores it and prints what it got as one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from model.layers import param
from model.moe import RouterBias


class Small(nnx.Module):
  """A stand-in model: two Params with logical axes and a non-Param RouterBias."""

  def __init__(self, seed: int):
    rngs = nnx.Rngs(seed)
    self.w = param(rngs, (8, 6), ("expert", "embed"), jnp.float32, init="normal")
    self.b = param(rngs, (5,), ("norm",), jnp.float32, init="normal")
    self.router_bias = RouterBias(jnp.arange(8, dtype=jnp.float32) + seed, axes=("expert",))


def small_values(seed: int) -> dict:
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(Small(seed))))


async def _block_forever(*args, **kwargs):
  print("READY", flush=True)
  while True:
    await asyncio.sleep(3600)


def _patch_stop(where: str) -> None:
  from orbax.checkpoint._src.handlers import json_checkpoint_handler
  from orbax.checkpoint._src.path import atomicity

  if where == "commit":
    atomicity.AtomicRenameTemporaryPath.finalize = _block_forever
    return

  async def half_written(self, x, directory):
    text = json.dumps(x)
    (directory / self._filename).write_text(text[:len(text) // 2])
    await _block_forever()

  json_checkpoint_handler.JsonCheckpointHandler._save_fn = half_written


def kill(directory: str, where: str) -> None:
  from training.checkpoint import Checkpointer
  ckpt = Checkpointer(directory, every=1, keep=5, async_save=True)
  ckpt.save(1, model=Small(1), data_state={"pos": 1}, rng=jax.random.key(1))
  ckpt.wait()
  _patch_stop(where)
  ckpt.save(2, model=Small(2), data_state={"pos": 2}, rng=jax.random.key(2))
  time.sleep(600)  # the parent kills us long before this
  raise SystemExit("not killed")


def multihost(directory: str, coordinator: str, process_id: int) -> None:
  jax.distributed.initialize(coordinator, num_processes=2, process_id=process_id)
  from sharding import mesh as mesh_lib
  from sharding.state import shard_model
  from training.checkpoint import Checkpointer
  mesh = mesh_lib.make_mesh({"data": 1, "fsdp": 1, "expert": 4, "tensor": 1})
  model = shard_model(Small(7), mesh)
  assert not model.w[...].is_fully_addressable  # really split across the two processes
  with Checkpointer(directory, every=1, keep=2) as ckpt:
    ckpt.save(3, model=model, data_state={"process": process_id, "pos": [process_id, 5]},
              rng=jax.random.key(9), config={"variant": "small-test"})
    ckpt.wait()
    target = shard_model(Small(0), mesh)
    meta = ckpt.restore(model=target)
  w = multihost_utils.process_allgather(target.w[...], tiled=True)
  print(json.dumps({"process": process_id, "data_state": meta["data_state"],
                    "step": meta["step"], "process_count": meta["process_count"],
                    "w_equal": bool(np.array_equal(np.asarray(w), small_values(7)["w"])),
                    "bias_equal": bool(np.array_equal(
                        np.asarray(multihost_utils.process_allgather(
                            target.router_bias[...], tiled=True)),
                        small_values(7)["router_bias"]))}), flush=True)


if __name__ == "__main__":
  if sys.argv[1] == "kill":
    kill(sys.argv[2], sys.argv[3])
  elif sys.argv[1] == "multihost":
    multihost(sys.argv[2], sys.argv[3], int(sys.argv[4]))
  else:
    raise SystemExit(f"unknown mode {sys.argv[1]!r}; use kill or multihost.")
