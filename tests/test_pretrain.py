"""The one training loop end to end: resume gives the same weights as no interruption.

The grain pipeline through the launcher, killed with SIGKILL and resumed; the
byte pipeline on an 8-device mesh, stopped and resumed in-process.
Slow (three launcher processes, ~3 minutes on 2 cores): `python -m pytest -q -m slow`.
"""

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from tests.helpers import kill_once_saved, subprocess_env
from training.checkpoint import restore_params

ROOT = Path(__file__).resolve().parents[1]


def _cmd(workdir, prepared, steps):
  return [sys.executable, "-m", "experiments.pretrain", "--config=configs/pretrain.py:tiny",
          f"--workdir={workdir}", f"--config.data.prepared_dir={prepared}",
          "--config.data.max_docs=120", f"--config.train.steps={steps}",
          "--config.train.global_batch=4", "--config.train.seq_len=32", "--config.checkpoint.every=10",
          "--config.metrics.log_every=1", "--config.metrics.tensorboard=False",
          "--config.metrics.peak_flops=1e12"]


def _params(workdir, step, variant="tiny"):
  from configs import pretrain
  from model.config import ModelConfig
  from model.decoder import abstract_model
  cfg = ModelConfig.from_config(pretrain.get_config(variant).model)
  model = abstract_model(cfg)
  graphdef, state = nnx.split(model)
  model = nnx.merge(graphdef, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), state))
  restore_params(Path(workdir) / "checkpoints", model, step=step)
  return {jax.tree_util.keystr(p): np.asarray(v) for p, v in
          jax.tree_util.tree_leaves_with_path(nnx.state(model))}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  base = tmp_path_factory.mktemp("pretrain")
  prepared = base / "data"
  run = subprocess.run(_cmd(base / "straight", prepared, 60), cwd=ROOT, env=subprocess_env(1), text=True,
                       capture_output=True, timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  summary = json.loads(run.stdout.strip().splitlines()[-1])
  return base, prepared, summary


@pytest.mark.slow
def test_straight_run_learns_and_checkpoints(straight):
  base, _, summary = straight
  assert summary["start_step"] == 0 and summary["latest_checkpoint"] == 60
  assert summary["losses"][-1] < summary["losses"][0] - 1.0
  lines = (base / "straight" / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 60 and {"loss", "perplexity", "tokens_per_s", "mfu", "learning_rate",
                               "grad_norm"} <= set(json.loads(lines[-1]))
  assert sorted(int(p.name) for p in (base / "straight" / "checkpoints").iterdir()) == [40, 50, 60]


@pytest.mark.slow
def test_sigkill_and_resume_is_identical(straight):
  base, prepared, _ = straight
  work = base / "killed"
  proc = subprocess.Popen(_cmd(work, prepared, 60), cwd=ROOT, env=subprocess_env(1), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  kill_once_saved(proc, work / "checkpoints" / "10")
  done = sorted(int(p.name) for p in (work / "checkpoints").iterdir() if p.name.isdigit())
  assert 60 not in done, f"the run finished before the kill ({done}); the test proves nothing"
  run = subprocess.run(_cmd(work, prepared, 60), cwd=ROOT, env=subprocess_env(1), text=True,
                       capture_output=True, timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  summary = json.loads(run.stdout.strip().splitlines()[-1])
  assert summary["start_step"] in done and summary["start_step"] >= 10
  a, b = _params(base / "straight", 60), _params(work, 60)
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(b[k], a[k], err_msg=k)


def _bytes_config(steps):
  from configs import pretrain
  config = pretrain.get_config("tiny_sharded")
  config.data.pipeline = "bytes"
  config.mesh.update(data=2, fsdp=1, expert=4, tensor=1)
  config.train.update(steps=steps, global_batch=8, seq_len=32)
  config.checkpoint.every = 2
  config.metrics.update(log_every=1, tensorboard=False, peak_flops=1e12)
  return config


@pytest.mark.slow
def test_byte_pipeline_on_a_mesh_resumes_exactly(tmp_path):
  """2 steps, stop, 2 more == 4 straight: the byte batches need no iterator state."""
  from training import loop
  straight = loop.run(_bytes_config(4), str(tmp_path / "straight"))
  first = loop.run(_bytes_config(2), str(tmp_path / "resumed"))
  second = loop.run(_bytes_config(4), str(tmp_path / "resumed"))
  assert straight["pipeline"] == "bytes" and straight["prepared_dir"] is None
  assert first["start_step"] == 0 and second["start_step"] == 2 and second["latest_checkpoint"] == 4
  np.testing.assert_array_equal(first["losses"] + second["losses"], straight["losses"])
  a, b = _params(tmp_path / "straight", 4, "tiny_sharded"), _params(tmp_path / "resumed", 4, "tiny_sharded")
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(b[k], a[k], err_msg=k)
