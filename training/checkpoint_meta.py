"""A checkpoint's `meta` item (JSON) and the checkpoint errors; `training.checkpoint` re-exports them.

meta holds the format version, the step, the RNG key's data, the data iterator state of every
process (opaque JSON; each process reads its own slice of the data) and the run's config.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Mapping

import jax
import numpy as np

from sharding import distributed

FORMAT_VERSION = 1

_log = logging.getLogger("training.checkpoint")


class CheckpointError(ValueError):
  """A checkpoint that cannot be used as asked (missing item, other config, ...)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
  """No (finalized) checkpoint where one was expected."""



# ---- meta (JSON) --------------------------------------------------------------------


def _json_safe(x: Any, where: str) -> Any:
  """A JSON-serialisable copy of x (ConfigDicts, dataclasses, tuples, numpy scalars)."""
  if hasattr(x, "to_dict"):  # ml_collections ConfigDict / FrozenConfigDict
    x = x.to_dict()
  elif dataclasses.is_dataclass(x) and not isinstance(x, type):
    x = dataclasses.asdict(x)
  if isinstance(x, Mapping):
    return {str(k): _json_safe(v, f"{where}.{k}") for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_json_safe(v, f"{where}[{i}]") for i, v in enumerate(x)]
  if isinstance(x, np.generic) or (isinstance(x, np.ndarray) and x.ndim == 0):
    return x.item()
  if x is None or isinstance(x, (bool, int, float, str)):
    return x
  raise CheckpointError(f"{where}={x!r} ({type(x).__name__}) cannot be stored as JSON; pass "
                        "plain values (numbers, strings, lists, dicts).")


def _host(x: jax.Array) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    if not x.is_fully_replicated:
      raise CheckpointError("rng: a key split over processes cannot be saved; replicate it.")
    x = x.addressable_data(0)
  return np.asarray(x)


def rng_to_json(rng: jax.Array | None) -> dict | None:
  """{'impl': name or None for a raw uint32 key, 'data': nested list of uint32}."""
  if rng is None:
    return None
  rng = jax.numpy.asarray(rng) if not isinstance(rng, jax.Array) else rng
  if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
    return {"impl": str(jax.random.key_impl(rng)), "data": _host(jax.random.key_data(rng)).tolist()}
  if rng.dtype != np.uint32:
    raise CheckpointError(f"rng: dtype {rng.dtype}; pass a jax.random.key or a uint32 PRNGKey.")
  return {"impl": None, "data": _host(rng).tolist()}


def rng_from_json(obj: dict | None) -> jax.Array | None:
  if obj is None:
    return None
  data = np.asarray(obj["data"], np.uint32)
  if obj["impl"] is None:
    return jax.numpy.asarray(data)
  return jax.random.wrap_key_data(data, impl=obj["impl"])


def _gather_json(obj: Any) -> list[Any]:
  """Every process's `obj` (JSON-safe), in process order; all processes must call it."""
  return [json.loads(b) for b in distributed.allgather_bytes(json.dumps(obj).encode())]


def make_meta(step: int, data_state: Any, rng: Any, config: Any) -> dict:
  return {"format_version": FORMAT_VERSION, "step": int(step),
          "rng": rng_to_json(rng),
          "data_states": _gather_json(_json_safe(data_state, "data_state")),
          "config": _json_safe(config, "config")}


def read_meta_dict(meta: Any, where: str) -> dict:
  """The user-facing meta: this process's data_state, the rng as a key.

  One data state stored for every process alike (the byte and SFT pipelines, RL's sampler: each
  addressed by step, not by process) resumes exactly on any process count: states that are all
  equal are handed to every process. Unequal states on another count give data_state None. A
  pipeline whose states are per process (grain's) must also compare `process_count` with this
  run's (training/loop.py does): its states are often equal, and still name other documents.
  """
  damaged = f"{where}: item 'meta' is damaged"
  if not isinstance(meta, Mapping):
    raise CheckpointError(f"{damaged}: a JSON object was expected, got {type(meta).__name__}.")
  version = meta.get("format_version")
  step = meta.get("step")
  ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (version, step))
  if not ints or version < 1 or step < 0:
    raise CheckpointError(f"{damaged}: format_version={version!r}, step={step!r} "
                          "(ints expected: a version from 1, a step from 0).")
  if version > FORMAT_VERSION:
    raise CheckpointError(f"{where}: format_version {version!r}; this code reads versions up to "
                          f"{FORMAT_VERSION} (update Horizon to read it).")
  states = meta.get("data_states") or [None]
  if not isinstance(states, list):
    raise CheckpointError(f"{damaged}: data_states={states!r:.80} is not a list.")
  data_state = None
  if len(states) == jax.process_count():
    data_state = states[jax.process_index()]
  elif all(s == states[0] for s in states):
    data_state = states[0]
  else:
    _log.warning("%s: data iterator states of %d processes, running on %d; the data pipeline "
                 "restarts instead of resuming exactly.", where, len(states), jax.process_count())
  try:
    rng = rng_from_json(meta.get("rng"))
  except (KeyError, TypeError, ValueError, OverflowError) as e:
    raise CheckpointError(f"{damaged}: rng={meta.get('rng')!r:.80} ({type(e).__name__}: {e}).") from None
  return {"step": meta["step"], "rng": rng, "data_state": data_state,
          "config": meta.get("config"), "format_version": version,
          "process_count": len(states)}
