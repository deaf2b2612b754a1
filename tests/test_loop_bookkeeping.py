"""training/loop.py bookkeeping with the model and train step faked out: which step each checkpoint
is saved under, which steps are logged, what a resume restores, and the tokens a step's metrics
count. The real end-to-end resume is tests/test_pretrain.py (slow)."""

import contextlib
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import pretrain
from training import loop


class _Data:
  pipeline = "fake"
  per_process_state = False

  def __init__(self):
    self.restored, self.asked = [], []

  def start(self):
    pass

  def batch(self, step):
    self.asked.append(step)
    return {"step": step}

  def get_state(self):
    return {"after": len(self.asked)}

  def set_state(self, state):
    self.restored.append(state)

  def summary(self):
    return {}


class _FakeRun:
  """Stands for loop._Run in `loop.run`: records saves and the steps it was asked to train."""

  start_at = 0

  def __init__(self, config, workdir, make_batches):
    self.cfg = None
    self.tc = types.SimpleNamespace(steps=7, seq_len=5, global_batch=3)
    self.mesh, self.data, self.saved, self.trained = None, _Data(), [], []
    self.ckpt = types.SimpleNamespace(wait=lambda: None, close=lambda: None, directory="ck",
                                      latest_step=lambda: self.saved[-1][0])
    _FakeRun.last = self

  def build(self):
    self.start = self.start_at

  def step(self, step, flops_train, peak):
    self.trained.append(step)
    return {"loss": 10.0 - step, "tokens_per_s": 1.0, "mfu": 0.5}

  def save(self, step, force=False):
    self.saved.append((step, force, self.trained[-1] if self.trained else None))


@pytest.mark.parametrize("start", [0, 3])
def test_run_saves_each_step_under_the_number_of_steps_done_and_logs_the_last(tmp_path, monkeypatch, start):
  config = pretrain.get_config("tiny")
  config.metrics.update(log_every=4, tensorboard=False, peak_flops=1e12)
  monkeypatch.setattr(loop, "_Run", type("R", (_FakeRun,), {"start_at": start}))
  monkeypatch.setattr(loop.flops, "flops_per_token", lambda cfg, seq_len: {"train_model": 1.0})
  monkeypatch.setattr(loop, "mesh_lib", types.SimpleNamespace(activate=lambda mesh: contextlib.nullcontext()))
  summary = loop.run(config, str(tmp_path))
  r = _FakeRun.last
  assert r.trained == list(range(start, 7))
  # After training step s (0-based), s + 1 steps are done: the checkpoint of s + 1 resumes at s + 1.
  want = [(s + 1, False, s) for s in range(start, 7)] + [(7, True, 6)]
  assert r.saved == want
  logged = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert logged == [s for s in range(start, 7) if s % 4 == 0 or s == 6]
  assert summary["start_step"] == start and summary["losses"] == [10.0 - s for s in range(start, 7)]


def test_a_failing_step_closes_the_checkpointer_and_the_logger(tmp_path, monkeypatch, capsys):
  """The logger was left open (TensorBoard's buffered events lost, no summary line) when a step raised."""
  config = pretrain.get_config("tiny")
  config.metrics.update(log_every=1, tensorboard=False, peak_flops=1e12)

  class Failing(_FakeRun):
    def step(self, step, flops_train, peak):
      if step == 3:
        raise FloatingPointError("loss is NaN at step 3")
      return super().step(step, flops_train, peak)

  closed = []
  monkeypatch.setattr(loop, "_Run", Failing)
  monkeypatch.setattr(loop.flops, "flops_per_token", lambda cfg, seq_len: {"train_model": 1.0})
  monkeypatch.setattr(loop, "mesh_lib", types.SimpleNamespace(activate=lambda mesh: contextlib.nullcontext()))
  real = loop.metrics_lib.MetricsLogger
  monkeypatch.setattr(loop.metrics_lib, "MetricsLogger",
                      type("L", (real,), {"close": lambda self: closed.append(1) or real.close(self)}))
  with pytest.raises(FloatingPointError, match="step 3"):
    loop.run(config, str(tmp_path))
  assert closed == [1] and Failing.last.saved == [(1, False, 0), (2, False, 1), (3, False, 2)]
  summary = json.loads(capsys.readouterr().out.split("summary: ")[-1])
  assert summary["logged_steps"] == 3 and summary["last_step"] == 2 and summary["final_loss"] == 8.0, summary


def _bare_run(monkeypatch, meta, per_process=False):
  """A loop._Run whose build() restores `meta` (model, optimizer and checkpointer faked)."""
  r = object.__new__(loop._Run)
  r.config, r.workdir, r.cfg, r.mesh = pretrain.get_config("tiny"), "w", None, None
  r.tc, r.data = None, _Data()
  r.data.per_process_state = per_process
  monkeypatch.setattr(loop, "create_sharded_model", lambda make, mesh: "model")
  monkeypatch.setattr(loop, "make_train_state", lambda model, tc: "opt")
  monkeypatch.setattr(loop, "grad_names", lambda model, opt: [])

  class _Ck:
    def __init__(self, *a, **k):
      self.directory = "ck"

    def latest_step(self):
      return meta["step"]

    def restore(self, model, optimizer):
      return meta

  monkeypatch.setattr(loop, "Checkpointer", _Ck)
  r.build()
  return r


def test_build_restores_step_rng_and_data_state(monkeypatch):
  key = jax.random.key(1234)
  r = _bare_run(monkeypatch, {"step": 5, "data_state": {"next": 17}, "process_count": 1, "rng": key})
  assert r.start == 5 and r.data.restored == [{"next": 17}]
  np.testing.assert_array_equal(jax.random.key_data(r.rng), jax.random.key_data(key))
  # One state stored for every process alike (read_meta gives it on any count): restored.
  r = _bare_run(monkeypatch, {"step": 2, "data_state": {"pipeline": "bytes", "seed": 0},
                              "process_count": 2, "rng": None})
  assert r.data.restored == [{"pipeline": "bytes", "seed": 0}]
  np.testing.assert_array_equal(jax.random.key_data(r.rng), jax.random.key_data(jax.random.key(0)))
  # Per-process states written on another process count: the pipeline restarts.
  r = _bare_run(monkeypatch, {"step": 2, "data_state": None, "process_count": 2, "rng": None})
  assert r.data.restored == []


class _Clock:
  """Stands for loop.time: the data wait and the train step each move it by a set amount."""

  def __init__(self):
    self.now = 100.0

  def perf_counter(self):
    return self.now


class _SlowData(_Data):
  def __init__(self, clock):
    super().__init__()
    self.clock = clock

  def batch(self, step):
    self.clock.now += 5.0
    return super().batch(step)


def test_step_metrics_count_every_token_of_the_global_batch(monkeypatch):
  r = object.__new__(loop._Run)
  r.tc = types.SimpleNamespace(global_batch=6, seq_len=11, nan_policy="stop")
  clock = _Clock()
  monkeypatch.setattr(loop, "time", clock)
  r.data, r.model, r.optimizer, r.names = _SlowData(clock), "model", "opt", ["w"]
  raw = {"loss": jnp.float32(2.75), "ce": jnp.float32(2.5), "tokens": jnp.float32(61.0),
         "grad_norm": jnp.float32(0.625), "learning_rate": jnp.float32(3e-4), "finite": jnp.bool_(True),
         "grad_finite": jnp.array([True]), "param_finite": jnp.array([True])}

  def train_step(model, opt, batch, tc):
    clock.now += 2.0
    return raw
  monkeypatch.setattr(loop, "jit_train_step", train_step)
  monkeypatch.setattr(loop.metrics_lib, "router_bias_norm", lambda model: 0.0)
  out = r.step(4, 100.0, 1e9)
  assert r.data.asked == [4]
  assert out["tokens_per_s"] * out["step_seconds"] == pytest.approx(66.0)  # 6 rows x 11 tokens
  assert out["mfu"] == pytest.approx(100.0 * out["tokens_per_s"] / 1e9)
  assert out["learning_rate"] == pytest.approx(3e-4) and out["loss_tokens"] == 61.0
  # The batch's wait is data_seconds; the train step's time (tokens/s, MFU) leaves it out.
  assert out["data_seconds"] == 5.0 and out["step_seconds"] == 2.0


def test_per_process_states_restart_on_another_process_count(monkeypatch, caplog):
  """grain's states index each process's slice of the shards; processes that read as many batches
  store equal states, which read_meta hands to every process on any count. On another count the
  pipeline must restart (the same index names other documents); on the same count it resumes."""
  state = {"parent_state": {"next_index": 5}}
  with caplog.at_level("WARNING"):
    r = _bare_run(monkeypatch, {"step": 3, "data_state": state, "process_count": 2, "rng": None},
                  per_process=True)
  assert r.data.restored == [] and r.start == 3
  assert "written by 2 processes, this run has 1" in caplog.text and "restarts" in caplog.text
  r = _bare_run(monkeypatch, {"step": 3, "data_state": state, "process_count": 1, "rng": None},
                per_process=True)
  assert r.data.restored == [state]
  # a step-addressed state is resumed on any count
  r = _bare_run(monkeypatch, {"step": 3, "data_state": state, "process_count": 2, "rng": None})
  assert r.data.restored == [state]


def test_every_pipeline_says_whether_its_state_is_per_process():
  from rl.sft.source import SFTBatches
  from training.batches import ByteBatches, GrainBatches

  assert GrainBatches.per_process_state and not ByteBatches.per_process_state
  assert not SFTBatches.per_process_state
