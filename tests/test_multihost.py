"""Multi-process training with the one launcher: 2 local processes x 2 CPU devices == 1 process x 4.

The byte pipeline (config.data.pipeline='bytes') addresses every batch row by
(seed, step, row), so both runs train on the same global batches.
"""

import json
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from configs import pretrain
from model.config import model_config
from sharding import distributed
from sharding import mesh as mesh_lib
from tests.helpers import assert_close, subprocess_env
from training import byte_corpus
from training.batches import ByteBatches
from training.data_sources import DataError
from training.train_step import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [sys.executable, "-m", "experiments.pretrain", "--config=configs/pretrain.py:tiny_sharded",
         "--config.data.pipeline=bytes", "--config.mesh.fsdp=1", "--config.mesh.data=1",
         "--config.mesh.expert=4", "--config.train.steps=3", "--config.train.global_batch=8",
         "--config.train.seq_len=32", "--config.metrics.log_every=1", "--config.metrics.tensorboard=False",
         "--config.metrics.peak_flops=1e12"]


def _summary(out: str) -> dict:
  return json.loads(out.strip().splitlines()[-1])


def _multi_env() -> dict:
  """Two CPU devices per process and no persistent compilation cache.

  Only process 0 writes that cache and process 1 finds none of its own (measured: 24 s to build
  the model state process 0 loaded in 4 s), so with a warm cache process 1 reaches the first
  train step's all-to-all a whole compile later, and gloo gives up on setting up a communicator
  whose members arrive > 30 s apart. Both compiling keeps them in step.
  """
  env = subprocess_env(2)
  env.pop("JAX_COMPILATION_CACHE_DIR")
  return env


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
  """Slow (three JAX processes, ~2 minutes on 2 cores): `python -m pytest -q -m slow`."""
  port = _free_port()
  multi_dir, single_dir = tmp_path / "multi", tmp_path / "single"
  procs = [subprocess.Popen(TRAIN + [f"--workdir={multi_dir}", f"--coordinator_address=127.0.0.1:{port}",
                                     "--num_processes=2", f"--process_id={i}"], cwd=ROOT,
                            env=_multi_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE) for i in range(2)]
  outs = []
  for p in procs:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    outs.append(out)
  multi = _summary(outs[0])
  # Only process 0 reports: no progress line, logger summary or JSON on process 1 (gloo's
  # connection messages go to stdout too).
  assert not any(line.startswith(("{", "step ", "summary: ")) for line in outs[1].splitlines()), outs[1]
  single_run = subprocess.run(TRAIN + [f"--workdir={single_dir}"], cwd=ROOT, env=subprocess_env(4),
                              text=True, capture_output=True, timeout=600)
  assert single_run.returncode == 0, single_run.stderr[-3000:]
  single = _summary(single_run.stdout)
  assert multi["processes"] == 2 and multi["devices"] == 4 and multi["pipeline"] == "bytes"
  assert single["processes"] == 1 and single["devices"] == 4
  assert len(multi["losses"]) == 3 and np.all(np.isfinite(multi["losses"]))
  assert_close(multi["losses"], single["losses"], what="per-step losses, 2 processes vs 1")
  assert multi["latest_checkpoint"] == single["latest_checkpoint"] == 3
  # Per-step metrics: one JSON line per step, written by process 0 alone.
  per_step = [json.loads(line) for line in (multi_dir / "metrics.jsonl").read_text().splitlines()]
  assert [m["step"] for m in per_step] == [0, 1, 2]
  assert [m["dropped"] for m in per_step] == [0.0, 0.0, 0.0]
  assert [m["loss"] for m in per_step] == multi["losses"]


_LATE = """
import sys, time
from jax.experimental import multihost_utils
from sharding import distributed
pid = int(sys.argv[1])
distributed.initialize("auto", coordinator_address=sys.argv[2], num_processes=2, process_id=pid)
t0 = time.time()
time.sleep(40 if pid == 0 else 0)  # process 0 busy, e.g. preparing the data
multihost_utils.sync_global_devices("late")
print("waited", round(time.time() - t0))
"""


@pytest.mark.slow
def test_barrier_survives_a_process_arriving_late():
  """sharding.distributed.initialize builds the barrier's gloo communicator up front (~1 minute)."""
  address = f"127.0.0.1:{_free_port()}"
  procs = [subprocess.Popen([sys.executable, "-c", _LATE, str(i), address], cwd=ROOT, env=_multi_env(),
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
  for p in procs:
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    assert int(out.split("waited")[-1]) >= 40


def test_launcher_rejects_incomplete_distributed_flags(tmp_path):
  run = subprocess.run(TRAIN + [f"--workdir={tmp_path}", "--num_processes=2"], cwd=ROOT,
                       env=subprocess_env(2), text=True, capture_output=True, timeout=300)
  assert run.returncode != 0
  assert "missing ['coordinator_address', 'process_id']" in run.stderr


def test_distributed_settings_fall_back_to_the_environment():
  env = {"JAX_COORDINATOR_ADDRESS": "h0:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2",
         "JAX_LOCAL_DEVICE_IDS": "0,1"}
  assert distributed.settings(env=env) == {"coordinator_address": "h0:1234", "num_processes": 4,
                                           "process_id": 2, "local_device_ids": [0, 1]}
  s = distributed.settings("h1:99", 2, 0, "3", env=env)  # arguments win
  assert s == {"coordinator_address": "h1:99", "num_processes": 2, "process_id": 0, "local_device_ids": [3]}
  assert distributed.settings(env={})["coordinator_address"] is None
  with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two' must be an integer"):
    distributed.settings(env={"JAX_NUM_PROCESSES": "two"})
  assert distributed.initialize("auto", env={}) is False  # one process: nothing to initialise
  with pytest.raises(ValueError, match=r"--process_id=2 must be in \[0, --num_processes=2\)"):
    distributed.initialize("auto", coordinator_address="h:1", num_processes=2, process_id=2, env={})
  with pytest.raises(ValueError, match="--distributed='maybe'"):
    distributed.initialize("maybe")


def test_byte_batches_are_addressed_and_resume_without_state():
  config = pretrain.get_config("tiny_sharded")
  config.data.pipeline = "bytes"
  tc = TrainConfig.from_config(config.train)
  mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 1, "expert": 2, "tensor": 2})
  batches = ByteBatches(config, model_config(config), mesh, tc)
  corpus = byte_corpus.load_stdlib_bytes()
  want = byte_corpus.lm_rows(corpus, config.data.shuffle_seed, 7, np.arange(tc.global_batch), tc.seq_len)
  got = batches.batch(7)
  for k, v in want.items():
    np.testing.assert_array_equal(np.asarray(jax.device_get(got[k])), v)
  batches.set_state(batches.get_state())  # its own state: accepted, nothing to restore
  with pytest.raises(DataError, match="pipeline='grain'"):
    batches.set_state({"something": "grain wrote"})
  with pytest.raises(DataError, match="shuffle_seed=5"):
    batches.set_state({"pipeline": "bytes", "seed": 5})


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


_ALLGATHER = """
import json, pickle, sys
from sharding import distributed
pid = int(sys.argv[1])
distributed.initialize("auto", coordinator_address=sys.argv[2], num_processes=2, process_id=pid)
mine = [b"", bytes(range(256)) * 3 + b"\\x00"][pid]  # lengths 0 and 769, zero bytes inside
print(json.dumps([b.hex() for b in distributed.allgather_bytes(mine)]))
"""


def test_allgather_bytes_returns_every_process_string_in_order():
  """The one exchange behind checkpoint data states and RL episodes: ragged lengths, raw bytes."""
  address = f"127.0.0.1:{_free_port()}"
  procs = [subprocess.Popen([sys.executable, "-c", _ALLGATHER, str(i), address], cwd=ROOT, env=_multi_env(),
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
  want = [b"", bytes(range(256)) * 3 + b"\x00"]
  for p in procs:
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    assert [bytes.fromhex(h) for h in json.loads(out.strip().splitlines()[-1])] == want
  assert distributed.allgather_bytes(b"one process") == [b"one process"]
