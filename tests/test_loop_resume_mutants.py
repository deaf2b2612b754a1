"""training/loop.py resume bookkeeping against references written out here (each test names the
mistake it catches): what a save stores, where a fresh run's weights come from, a crash after a
save, the run-length check, and the loop's knobs. The model is the small `Small` stand-in."""

import contextlib
import re
import types

import jax
import ml_collections
import numpy as np
import pytest

from configs import pretrain
from tests._checkpoint_child import Small, small_values
from training import checkpoint as ck
from training import loop


class _Data:
  pipeline = "fake"
  per_process_state = False

  def __init__(self, state=None):
    self.state, self.restored = state, []

  def start(self):
    pass

  def get_state(self):
    return self.state

  def set_state(self, state):
    self.restored.append(state)

  def summary(self):
    return {}


def _assert_small(module, seed, what):
  got = {k: np.asarray(v) for k, v in ck._flat(ck.model_tree(module)).items()}
  want = ck._flat(small_values(seed))
  assert sorted(got) == sorted(want), what
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=f"{what}: {k}")


def test_a_save_stores_the_rng_the_data_position_and_the_config(tmp_path):
  """A resume reads the rng, the data state and the config from what _Run.save stored; a mutant that
  stored none of one resumed with the seed's key, restarted the data, or lost the model check."""
  config = pretrain.get_config("tiny")
  config.train.steps = 9
  r = object.__new__(loop._Run)
  r.config, r.model, r.optimizer = config, Small(4), None
  r.data, r.rng = _Data({"next_index": 12, "epoch": 1}), jax.random.key(77)
  r.ckpt = ck.Checkpointer(tmp_path, every=1, keep=1, async_save=False)
  assert r.save(3)
  r.ckpt.close()
  meta = ck.read_meta(tmp_path)
  assert meta["step"] == 3 and meta["data_state"] == {"next_index": 12, "epoch": 1}
  np.testing.assert_array_equal(jax.random.key_data(meta["rng"]), jax.random.key_data(jax.random.key(77)))
  assert meta["config"]["train"]["steps"] == 9 and meta["config"]["model"]["vocab_size"] == 331


def _fresh_run(monkeypatch, tmp_path, init_from="", workdir="w"):
  """A loop._Run whose build() runs with the real Checkpointer on <tmp_path>/w and a Small model."""
  config = pretrain.get_config("tiny")
  config.seed = 5
  config.checkpoint.update(init_from=init_from, every=3, keep=2, async_save=False)
  r = object.__new__(loop._Run)
  r.config, r.workdir, r.data = config, str(tmp_path / workdir), _Data()
  r.cfg = r.mesh = r.tc = None
  monkeypatch.setattr(loop, "create_sharded_model", lambda make, mesh: Small(0))
  monkeypatch.setattr(loop, "make_train_state", lambda model, tc: None)
  monkeypatch.setattr(loop, "grad_names", lambda model, opt: [])
  r.build()
  # config.checkpoint.every=3 (a mutant swapped every and keep), async_save=False (one ignored it)
  assert [r.ckpt.should_save(s) for s in range(5, 10)] == [False, True, False, False, True]
  assert r.ckpt._mngr._options.enable_async_checkpointing is False
  r.ckpt.close()
  return r


def test_a_fresh_run_takes_init_from_weights_and_a_resumed_run_its_own(monkeypatch, tmp_path):
  """init_from gives a fresh run its weights (a mutant that skipped restore_params trained from
  random weights, saying 'initialised'); the step, rng and data start anew. A run with its own
  checkpoint resumes that one instead."""
  with ck.Checkpointer(tmp_path / "sft", every=1, keep=1) as c:
    c.save(40, model=Small(6), data_state={"other": "run"}, rng=jax.random.key(1))
  r = _fresh_run(monkeypatch, tmp_path, init_from=str(tmp_path / "sft"))
  _assert_small(r.model, 6, "weights of init_from")
  assert r.start == 0 and r.data.restored == []
  np.testing.assert_array_equal(jax.random.key_data(r.rng), jax.random.key_data(jax.random.key(5)))
  with ck.Checkpointer(tmp_path / "w" / "checkpoints", every=1, keep=1) as c:
    c.save(3, model=Small(8), data_state={"own": 3}, rng=jax.random.key(9))
  r = _fresh_run(monkeypatch, tmp_path, init_from=str(tmp_path / "sft"))
  _assert_small(r.model, 8, "the run's own step 3")
  assert r.start == 3 and r.data.restored == [{"own": 3}]
  np.testing.assert_array_equal(jax.random.key_data(r.rng), jax.random.key_data(jax.random.key(9)))


def test_a_checkpoint_without_a_data_state_hands_none_to_the_pipeline(monkeypatch, tmp_path):
  """Saved on this process count with no data state: the pipeline is told (set_state(None): the
  byte pipeline then names the grain run it came from); a mutant skipped it and trained on."""
  with ck.Checkpointer(tmp_path / "v" / "checkpoints", every=1, keep=1) as c:
    c.save(2, model=Small(2), data_state=None)
  r = _fresh_run(monkeypatch, tmp_path, workdir="v")
  assert r.start == 2 and r.data.restored == [None]
  _assert_small(r.model, 2, "step 2")


def test_a_checkpoint_of_step_zero_is_resumed(monkeypatch, tmp_path):
  """Step 0 is a checkpoint like any other (a mutant tested `latest_step()` for truth and started
  from random weights)."""
  with ck.Checkpointer(tmp_path / "z" / "checkpoints", every=1, keep=1) as c:
    c.save(0, model=Small(4), data_state={"at": 0}, force=True)
  r = _fresh_run(monkeypatch, tmp_path, workdir="z")
  assert r.start == 0 and r.data.restored == [{"at": 0}]
  _assert_small(r.model, 4, "step 0")


def test_a_stored_config_this_code_cannot_read_is_warned_about_not_refused(tmp_path, caplog):
  """A stored config.model that no longer validates (an old checkpoint) cannot be compared: the run
  resumes as configured, saying so (a mutant refused the resume)."""
  config = pretrain.get_config("tiny")
  stored = config.to_dict()
  stored["model"]["expert_dim"] = 0
  with ck.Checkpointer(tmp_path / "checkpoints", every=1, keep=1) as c:
    c.save(2, model=Small(1), config=stored)
  with caplog.at_level("WARNING"):
    meta = loop.check_resume(config, loop.model_config(config), tmp_path / "checkpoints")
  assert meta["step"] == 2
  assert "cannot compare config.model with" in caplog.text and "expert_dim=0" in caplog.text


class _CrashingRun:
  """Stands for loop._Run: step 2 raises after the save of step 2 was started."""

  def __init__(self, config, workdir, make_batches):
    self.cfg, self.mesh, self.data = None, None, _Data()
    self.tc = types.SimpleNamespace(steps=5, seq_len=4, global_batch=2)
    self.events = []
    self.ckpt = types.SimpleNamespace(wait=lambda: self.events.append("wait"),
                                      close=lambda: self.events.append("close"), directory="ck",
                                      latest_step=lambda: None)
    _CrashingRun.last = self

  def build(self):
    self.start = 0

  def step(self, step, flops_train, peak):
    if step == 2:
      raise FloatingPointError("step 2: non-finite loss")
    return {"loss": 1.0, "tokens_per_s": 1.0, "mfu": 0.5}

  def save(self, step, force=False):
    self.events.append(("save", step, force))


def test_a_step_that_fails_commits_the_save_started_before_it(tmp_path, monkeypatch):
  """The saves are asynchronous: a step that raised (nan_policy='stop', the data, Ctrl-C) ended the
  process before the save started a step earlier was committed, and the resume went back up to
  `every` steps further (orbax left only '<step>.orbax-checkpoint-tmp')."""
  config = pretrain.get_config("tiny")
  config.metrics.update(tensorboard=False, peak_flops=1e12)
  monkeypatch.setattr(loop, "_Run", _CrashingRun)
  monkeypatch.setattr(loop.flops, "flops_per_token", lambda cfg, seq_len: {"train_model": 1.0})
  monkeypatch.setattr(loop, "mesh_lib", types.SimpleNamespace(activate=lambda mesh: contextlib.nullcontext()))
  with pytest.raises(FloatingPointError, match="step 2: non-finite loss"):
    loop.run(config, str(tmp_path))
  assert _CrashingRun.last.events == [("save", 1, False), ("save", 2, False), "close"]


def test_a_run_as_long_as_its_checkpoint_may_be_launched_again(tmp_path):
  """train.steps equal to the checkpoint's step is a finished run launched again (it trains nothing
  and saves nothing new): allowed; one step fewer is refused (a mutant refused both)."""
  config = pretrain.get_config("tiny")
  config.train.steps = 4
  with ck.Checkpointer(tmp_path / "checkpoints", every=1, keep=1) as c:
    c.save(4, model=Small(1), config=config.to_dict())
  assert loop.check_resume(config, loop.model_config(config), tmp_path / "checkpoints")["step"] == 4
  config.train.steps = 3
  with pytest.raises(ValueError, match=re.escape("config.train.steps=3 is below step 4")):
    loop.check_resume(config, loop.model_config(config), tmp_path / "checkpoints")
  # RL's length is config.rl.steps (a mutant read train.steps whatever the field)
  config.train.steps, config.rl = 10, ml_collections.ConfigDict({"steps": 2})
  with pytest.raises(ValueError, match=re.escape("config.rl.steps=2 is below step 4 of this run's")):
    loop.check_resume(config, loop.model_config(config), tmp_path / "checkpoints", steps_field="rl.steps")


@pytest.mark.parametrize("field,value,ok", [
    ("every", 1, True), ("keep", 1, True), ("every", True, False), ("keep", 0, False), ("every", None, False),
])
def test_checkpoint_knobs_take_ints_from_one(field, value, ok):
  """every=1 / keep=1 are the smallest valid values (a mutant used `<=`); True and None are refused
  (True was accepted as every=1)."""
  config = pretrain.get_config("tiny")
  config.checkpoint[field] = value
  if ok:
    loop.check_loop_config(config)
  else:
    said = f"config.checkpoint.{field}={value!r}: must be an int >= 1"
    with pytest.raises(ValueError, match=re.escape(said)):
      loop.check_loop_config(config)


def test_peak_flops_takes_zero_and_refuses_infinity():
  """0 means 'measure or look it up'; an infinite peak gave MFU 0 (a mutant dropped the bound)."""
  config = pretrain.get_config("tiny")
  for ok in (0.0, 1e12, 3):
    config.metrics.peak_flops = ok
    loop.check_loop_config(config)
  for bad in (float("inf"), float("nan"), -1.0):
    config.metrics.peak_flops = bad
    with pytest.raises(ValueError, match=re.escape(f"config.metrics.peak_flops={bad!r}: give the peak")):
      loop.check_loop_config(config)


def test_seq_len_up_to_max_seq_len_fits_the_layout():
  """seq_len == max_seq_len is allowed (a mutant used `>=`); one more is refused."""
  from sharding import mesh as mesh_lib
  from training.train_step import TrainConfig

  config = pretrain.get_config("tiny")
  cfg = loop.model_config(config)
  mesh = mesh_lib.make_mesh(config.mesh)
  config.train.seq_len = cfg.max_seq_len
  loop.check_layout(TrainConfig.from_config(config.train), cfg, mesh)
  config.train.seq_len = cfg.max_seq_len + 1
  with pytest.raises(ValueError, match=re.escape(f"config.train.seq_len={cfg.max_seq_len + 1} exceeds "
                                                 f"config.model.max_seq_len={cfg.max_seq_len}")):
    loop.check_layout(TrainConfig.from_config(config.train), cfg, mesh)


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_non_finite_step_stops_or_is_skipped_as_configured(monkeypatch, caplog, policy):
  """nan_policy='stop' raises naming the tensor; 'skip' warns and goes on (a mutant that never
  raised trained on past a NaN under 'stop')."""
  r = object.__new__(loop._Run)
  r.tc = types.SimpleNamespace(global_batch=2, seq_len=3, nan_policy=policy)
  r.data, r.model, r.optimizer, r.names = _Data(), "model", "opt", ["w", "b"]
  r.data.batch = lambda step: {"step": step}
  raw = {"loss": jax.numpy.float32(np.nan), "ce": jax.numpy.float32(np.nan), "tokens": jax.numpy.float32(6.0),
         "grad_norm": jax.numpy.float32(np.nan), "learning_rate": jax.numpy.float32(1e-3),
         "finite": jax.numpy.bool_(False), "grad_finite": jax.numpy.array([True, False]),
         "param_finite": jax.numpy.array([True, True])}
  monkeypatch.setattr(loop, "jit_train_step", lambda model, opt, batch, tc: raw)
  monkeypatch.setattr(loop.metrics_lib, "router_bias_norm", lambda model: 0.0)
  said = "step 7: loss is nan (1 of 2 gradients non-finite); the update was not applied"
  if policy == "stop":
    with pytest.raises(FloatingPointError, match=re.escape(said)):
      r.step(7, 1.0, 1e9)
  else:
    with caplog.at_level("WARNING"):
      out = r.step(7, 1.0, 1e9)
    assert said in caplog.text and np.isnan(out["loss"])


def test_nonnegative_numbers_take_zero_and_refuse_infinity():
  """training.knobs.check_nonnegative_numbers (the train and rl loss weights): 0 is allowed (a
  mutant used `0 <`), infinity and bools are refused (a mutant dropped the upper bound)."""
  from training import knobs

  knobs.check_nonnegative_numbers("train", {"a": 0, "b": 0.0, "c": 2.5}, ["a", "b", "c"])
  for bad in (float("inf"), -0.5, True, "1"):
    with pytest.raises(ValueError, match=re.escape(f"config.train.a={bad!r}: must be a finite number >= 0.")):
      knobs.check_nonnegative_numbers("train", {"a": bad}, ["a"])
