"""Multi-process training: 2 local processes x 2 CPU devices == 1 process x 4 devices."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from sharding import mesh as mesh_lib
from tests.helpers import assert_close, subprocess_env
from training import byte_corpus

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [sys.executable, "-m", "experiments.train", "--config=configs/horizon.py:tiny_sharded",
         "--config.mesh.fsdp=1", "--config.mesh.data=1", "--config.mesh.expert=4",
         "--config.train.steps=3", "--config.train.global_batch=8", "--config.train.seq_len=32"]


def _json_lines(out: str) -> list[dict]:
  return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _summary(out: str) -> dict:
  return _json_lines(out)[-1]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one_process():
  """Slow (three JAX processes, ~2 minutes on 2 cores): `python -m pytest -q -m slow`."""
  port = _free_port()
  procs = [subprocess.Popen(TRAIN + [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                                     f"--process_id={i}"], cwd=ROOT, env=subprocess_env(2), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
  outs = []
  for p in procs:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    outs.append(out)
  multi = _summary(outs[0])
  assert not any(line.startswith("{") for line in outs[1].splitlines())  # only process 0 reports
  single_run = subprocess.run(TRAIN, cwd=ROOT, env=subprocess_env(4), text=True, capture_output=True,
                              timeout=600)
  assert single_run.returncode == 0, single_run.stderr[-3000:]
  single = _summary(single_run.stdout)
  assert multi["processes"] == 2 and multi["devices"] == 4
  assert single["processes"] == 1 and single["devices"] == 4
  assert len(multi["losses"]) == 3 and np.all(np.isfinite(multi["losses"]))
  assert_close(multi["losses"], single["losses"], what="per-step losses, 2 processes vs 1")
  per_step = _json_lines(outs[0])[:-1]
  assert [m["dropped"] for m in per_step] == [0.0, 0.0, 0.0]


def test_launcher_rejects_incomplete_distributed_flags():
  run = subprocess.run(TRAIN + ["--num_processes=2"], cwd=ROOT, env=subprocess_env(2), text=True,
                       capture_output=True, timeout=300)
  assert run.returncode != 0
  assert "missing ['coordinator_address', 'process_id']" in run.stderr


def test_global_batch_builds_only_local_rows_once():
  mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 1, "expert": 2, "tensor": 2})
  corpus = byte_corpus.load_stdlib_bytes()
  calls = []

  def rows(r):
    calls.append(tuple(r))
    return byte_corpus.lm_rows(corpus, 0, 5, r, 16)

  batch = byte_corpus.global_batch(mesh, 8, 16, rows)
  # 4 batch shards, each replicated over tensor=2: built once per shard.
  assert sorted(calls) == [(0, 1), (2, 3), (4, 5), (6, 7)]
  whole = byte_corpus.lm_rows(corpus, 0, 5, np.arange(8), 16)
  for k, v in whole.items():
    np.testing.assert_array_equal(np.asarray(jax.device_get(batch[k])), v)
  assert batch["inputs"].sharding.spec[0] == ("data", "fsdp", "expert")
  np.testing.assert_array_equal(whole["targets"][:, :-1], whole["inputs"][:, 1:])
