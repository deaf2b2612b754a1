"""training/checkpoint.py bookkeeping against references written out here (each test names the
mistake it catches), on the small `Small` stand-in of tests/_checkpoint_child.py."""

import dataclasses
import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from tests._checkpoint_child import Small
from training import checkpoint as ck


def _values(module) -> dict:
  """{'w': array, ...} of a module's Variables, as numpy (the reference is Small(seed)'s init)."""
  return {k: np.asarray(v) for k, v in ck._flat(ck.model_tree(module)).items()}


def _assert_same(module, seed, what):
  got, want = _values(module), _values(Small(seed))
  assert sorted(got) == ["b", "router_bias", "w"], what
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=f"{what}: {k}")


def test_step_zero_is_a_checkpoint(tmp_path):
  """`save` takes any non-negative step (the docstring: 'step=-1 must be a non-negative int'); a
  mutant that refused 0 (`step <= 0`) broke saving the initial weights."""
  with ck.Checkpointer(tmp_path, every=5, keep=2) as c:
    assert c.save(0, model=Small(0), force=True)
    c.wait()
    assert c.all_steps() == [0]
  meta = ck.read_meta(tmp_path, step=0)
  assert meta["step"] == 0
  target = Small(9)
  ck.restore_params(tmp_path, target, step=0)
  _assert_same(target, 0, "step 0")


def test_restore_right_after_an_async_save_reads_that_step(tmp_path):
  """restore waits for the saves it started: without the wait it read the previous step (or
  none) while the newest was still being written."""
  with ck.Checkpointer(tmp_path, every=1, keep=3, async_save=True) as c:
    assert c.save(1, model=Small(1), data_state={"pos": 1})
    c.wait()
    assert c.save(2, model=Small(2), data_state={"pos": 2})
    target = Small(0)
    meta = c.restore(model=target)  # no wait() in between
    assert meta["step"] == 2 and meta["data_state"] == {"pos": 2}
    _assert_same(target, 2, "step 2 right after its save")


def test_restore_writes_the_optimizer_state_back(tmp_path):
  """The optimizer's step count and momentum come back from the checkpoint: a mutant that restored
  only the model resumed with a fresh optimizer (step 0, no momentum) and said nothing."""
  model = Small(1)
  optimizer = nnx.Optimizer(model, optax.sgd(0.5, momentum=0.5), wrt=nnx.Param)
  grads = nnx.State({"w": nnx.Param(np.ones((8, 6), np.float32)), "b": nnx.Param(np.ones(5, np.float32))})
  optimizer.update(model, grads)  # trace = 1; w -= 0.5 * 1
  optimizer.update(model, grads)  # trace = 0.5 * 1 + 1 = 1.5; w -= 0.5 * 1.5
  with ck.Checkpointer(tmp_path, every=1, keep=1) as c:
    c.save(2, model=model, optimizer=optimizer)
    c.wait()
    fresh = Small(7)
    fresh_opt = nnx.Optimizer(fresh, optax.sgd(0.5, momentum=0.5), wrt=nnx.Param)
    c.restore(model=fresh, optimizer=fresh_opt)
  assert int(fresh_opt.step[...]) == 2
  trace = ck._flat(ck.optimizer_tree(fresh_opt))
  np.testing.assert_array_equal(np.asarray(trace["opt_state/0/trace/w"]), np.full((8, 6), 1.5, np.float32))
  np.testing.assert_array_equal(np.asarray(trace["opt_state/0/trace/b"]), np.full(5, 1.5, np.float32))
  want_w = np.asarray(Small(1).w[...]) - 0.5 - 0.75
  np.testing.assert_allclose(np.asarray(fresh.w[...]), want_w, rtol=0, atol=1e-6)


def test_model_and_optimizer_state_is_saved_without_the_model(tmp_path):
  """nnx.ModelAndOptimizer holds its model: the 'opt_state' item must not store it a second time
  (the docstring's contract; a mutant kept it, doubling the checkpoint), and restoring into one
  wrote the model's params back (restoring into one raised a bare KeyError: 'model')."""
  model = Small(3)
  optimizer = nnx.ModelAndOptimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
  optimizer.step[...] = 3
  tree = ck.optimizer_tree(optimizer)
  assert sorted(tree) == ["opt_state", "step"]
  with ck.Checkpointer(tmp_path, every=1, keep=1) as c:
    c.save(1, model=model, optimizer=optimizer)
    c.wait()
  assert sorted(p.name for p in (tmp_path / "1").iterdir() if p.is_dir()) == ["meta", "opt_state", "params"]
  other = Small(0)
  with ck.Checkpointer(tmp_path, every=1, keep=1) as c:
    back = nnx.ModelAndOptimizer(other, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    c.restore(model=other, optimizer=back)  # raised KeyError: 'model'
  _assert_same(other, 3, "ModelAndOptimizer restore")
  assert int(back.step[...]) == 3 and back.model is other


def test_a_temporary_directory_left_by_a_killed_save_is_deleted(tmp_path):
  """The class docstring: temporary directories of a killed save are deleted by the writer (orbax
  finishes that clean-up before its first save). A mutant that kept them passed: the kill test
  saves that same step again, which overwrites it."""
  with ck.Checkpointer(tmp_path, every=1, keep=5) as c:
    c.save(1, model=Small(1))
  shutil.copytree(tmp_path / "1", tmp_path / "5.orbax-checkpoint-tmp")  # step 5, never committed
  (tmp_path / "5.orbax-checkpoint-tmp" / "_CHECKPOINT_METADATA").unlink(missing_ok=True)
  assert ck.read_meta(tmp_path)["step"] == 1  # readers ignore it, and leave it
  assert (tmp_path / "5.orbax-checkpoint-tmp").exists()
  with ck.Checkpointer(tmp_path, every=1, keep=5) as c:
    assert c.all_steps() == [1]
    c.save(2, model=Small(2))
    c.wait()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]


def test_missing_step_and_other_shapes_are_refused_naming_them(tmp_path):
  """A step that is not there, and a model whose shapes differ, fail naming the step / the tensor
  (mutants that dropped either check read another step or failed inside orbax)."""
  with ck.Checkpointer(tmp_path, every=2, keep=3) as c:
    for s in (2, 4):
      c.save(s, model=Small(s))
  with pytest.raises(ck.CheckpointNotFoundError,
                     match=r"no checkpoint for step 3 in .*finalized steps: \[2, 4\]"):
    ck.restore_params(tmp_path, Small(0), step=3)

  class Wider(nnx.Module):
    def __init__(self):
      small = Small(0)
      self.w, self.router_bias = small.w, small.router_bias
      self.b = nnx.Param(np.zeros(6, np.float32))

  with pytest.raises(ck.CheckpointError, match=r"step 4: params b has shape \(5,\) in the checkpoint but "
                                                 r"\(6,\) in the model; the checkpoint was written"):
    ck.restore_params(tmp_path, Wider())

  class Fewer(nnx.Module):
    def __init__(self):
      self.w = Small(0).w

  with pytest.raises(ck.CheckpointError, match=r"in the model but not the checkpoint: \[\]; in the "
                                                 r"checkpoint but not the model: \['b', 'router_bias'\]"):
    ck.restore_params(tmp_path, Fewer())


def test_an_empty_directory_name_is_refused_not_read_as_the_current_one(tmp_path, monkeypatch):
  """'' became epath.Path('') == '.': a mutant that let it through read or wrote checkpoints in the
  current directory."""
  monkeypatch.chdir(tmp_path)
  with ck.Checkpointer(tmp_path, every=1, keep=1) as c:
    c.save(1, model=Small(1))
  for call in (lambda: ck.read_meta(""), lambda: ck.Checkpointer("", every=1, keep=1),
               lambda: ck.restore_params("", Small(0))):
    with pytest.raises(ck.CheckpointError, match=r"checkpoint directory='': give a local path or a URL"):
      call()


def test_a_newer_format_version_is_refused(tmp_path):
  """A checkpoint written by a newer Horizon (format_version 2) is refused, naming both versions; a
  mutant that accepted one version more read it as version 1."""
  meta = ck.make_meta(3, None, None, {})
  assert meta["format_version"] == 1
  assert ck.read_meta_dict(meta, "ckpt")["format_version"] == 1
  with pytest.raises(ck.CheckpointError, match=r"ckpt: format_version 2; this code reads versions up to 1"):
    ck.read_meta_dict({**meta, "format_version": 2}, "ckpt")
  # A meta without data states (none stored) reads as one process with no state (a mutant raised
  # IndexError).
  bare = {k: v for k, v in meta.items() if k != "data_states"}
  got = ck.read_meta_dict(bare, "ckpt")
  assert got["data_state"] is None and got["process_count"] == 1 and got["step"] == 3


def _saved_with_model_config(directory, model: dict) -> None:
  with ck.Checkpointer(directory, every=1, keep=1) as c:
    c.save(1, model=Small(1), config={"model": model})


def test_stored_model_config_maps_renamed_and_drops_retired_fields(tmp_path):
  """The checkpoint's stored config.model wins over the fallback; a field since renamed
  (attention_impl -> kernels) is mapped unless its old value has no new meaning, and a field this
  code no longer has is dropped (mutants kept the old name, took any old value, or passed the
  retired field on, each failing or falling back to a guess)."""
  from configs import horizon

  fallback = horizon.get_config("tiny").model
  fallback.kernels = "xla"
  stored = fallback.to_dict()
  del stored["kernels"]
  stored.update(attention_impl="pallas", expert_dim=30, retired_knob=7)
  _saved_with_model_config(tmp_path / "a", stored)
  cfg = ck.stored_model_config(tmp_path / "a", fallback)
  assert cfg.kernels == "pallas" and cfg.expert_dim == 30 and fallback.expert_dim == 26
  stored["attention_impl"] = "splash"  # an old value that is not a kernels choice
  _saved_with_model_config(tmp_path / "b", stored)
  cfg = ck.stored_model_config(tmp_path / "b", fallback)
  assert cfg.kernels == "xla" and cfg.expert_dim == 30


@dataclasses.dataclass
class _Plain:
  n: int
  s: str


def test_meta_json_refuses_what_it_cannot_store_faithfully():
  """Tuples (ConfigDict's to_dict keeps them) are stored as lists (a mutant refused them); an rng
  that is neither a key nor uint32 is refused (a mutant stored an int32 array and restored it as
  uint32); a typed key comes back typed (a mutant stored only its data); a damaged meta
  (format_version True, data_states not a list) is named, not read."""
  meta = ck.make_meta(2, {"shards": (3, 4)}, None, {"mesh": (1, 8), "np": np.int64(5)})
  assert meta["config"] == {"mesh": [1, 8], "np": 5} and meta["data_states"] == [{"shards": [3, 4]}]
  assert type(meta["config"]["np"]) is int
  assert ck.make_meta(1, None, None, _Plain(3, "x"))["config"] == {"n": 3, "s": "x"}  # a dataclass
  with pytest.raises(ck.CheckpointError, match=r"rng: dtype int32; pass a jax.random.key or a uint32"):
    ck.rng_to_json(np.array([0, 7], np.int32))
  assert ck.rng_to_json(np.array([0, 7], np.uint32)) == {"impl": None, "data": [0, 7]}
  back = ck.read_meta_dict(ck.make_meta(1, None, jax.random.key(3, impl="rbg"), {}), "ckpt")["rng"]
  assert jax.dtypes.issubdtype(back.dtype, jax.dtypes.prng_key)  # a typed key, not its raw data
  assert str(jax.random.key_impl(back)) == str(jax.random.key_impl(jax.random.key(0, impl="rbg")))
  for bad in [{"format_version": True}, {"format_version": 0}, {"format_version": -1}, {"step": -1},
              {"step": True}, {"step": 2.0}]:
    with pytest.raises(ck.CheckpointError, match=r"ckpt: item 'meta' is damaged: format_version="):
      ck.read_meta_dict({**meta, **bad}, "ckpt")
  assert ck.read_meta_dict({**meta, "step": 0}, "ckpt")["step"] == 0
  with pytest.raises(ck.CheckpointError,
                     match=r"item 'meta' is damaged: data_states=\{'0': 1\} is not a list"):
    ck.read_meta_dict({**meta, "data_states": {"0": 1}}, "ckpt")
