"""A byte-level corpus from the running interpreter's standard library.

Every machine that runs Horizon has the Python standard library's source
(~30 MB of .py files), so this corpus needs no download. Tokens are raw bytes
(ids 0..255), which every Horizon vocabulary covers (`tiny` has 331).

Batches are addressed, not streamed: row r of step s is a window at an offset
drawn from `np.random.default_rng((seed, s, r))`. Any process can therefore
build exactly the rows its devices hold (`global_batch`), the global batch is
the same however many processes share it, and resuming at step s needs no
iterator state.
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from sharding.rules import activation_spec


@functools.lru_cache(maxsize=4)
def load_stdlib_bytes(max_bytes: int = 8 << 20) -> np.ndarray:
  """The first `max_bytes` of the stdlib's .py files (sorted paths), as uint8."""
  if not isinstance(max_bytes, int) or max_bytes < 1 << 16:  # not the environment's fault
    raise ValueError(f"max_bytes={max_bytes!r}: the byte corpus needs at least {1 << 16} bytes.")
  root = Path(sysconfig.get_paths()["stdlib"])
  chunks, total = [], 0
  for path in sorted(root.rglob("*.py")):
    if "site-packages" in path.parts:
      continue
    try:
      data = path.read_bytes()
    except OSError:
      continue
    chunks.append(data + b"\n")
    total += len(data) + 1
    if total >= max_bytes:
      break
  if total < 1 << 16:
    raise RuntimeError(f"only {total} bytes of Python source found under {root}; the byte corpus "
                       "needs the standard library's .py files.")
  return np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8)


def lm_rows(corpus: np.ndarray, seed: int, step: int, rows: np.ndarray, seq_len: int
            ) -> dict[str, np.ndarray]:
  """Unpacked next-token rows: inputs/targets/positions/segment_ids, each [len(rows), seq_len]."""
  windows = np.empty((len(rows), seq_len + 1), np.int32)
  for i, r in enumerate(rows):
    start = np.random.default_rng((seed, step, int(r))).integers(0, len(corpus) - seq_len - 1)
    windows[i] = corpus[start:start + seq_len + 1]
  n = len(rows)
  return {"inputs": windows[:, :-1], "targets": windows[:, 1:],
          "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (n, seq_len)).copy(),
          "segment_ids": np.ones((n, seq_len), np.int32)}


def global_batch(mesh: jax.sharding.Mesh, batch: int, seq_len: int,
                 make_rows: Callable[[np.ndarray], dict[str, np.ndarray]]) -> dict[str, jax.Array]:
  """A global batch sharded over the batch mesh axes, built from this process's rows only.

  make_rows(row_indices) -> dict of [len(rows), seq_len] arrays. Rows held by
  several local devices (replication over `tensor`) are built once.
  """
  shape = (batch, seq_len)
  sharding = jax.sharding.NamedSharding(
      mesh, activation_spec(("batch", "length"), shape, dict(mesh.shape)))
  index_map = sharding.addressable_devices_indices_map(shape)
  built: dict[tuple, dict[str, np.ndarray]] = {}
  per_device: dict[str, list[jax.Array]] = {}
  for device, index in index_map.items():
    rows = np.arange(batch)[index[0]]
    key = (int(rows[0]), len(rows)) if len(rows) else (0, 0)
    if key not in built:
      built[key] = make_rows(rows)
    for name, value in built[key].items():
      per_device.setdefault(name, []).append(jax.device_put(value, device))
  return {name: jax.make_array_from_single_device_arrays(shape, sharding, arrays)
          for name, arrays in per_device.items()}
