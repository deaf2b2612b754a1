"""training/checkpoint.py: round trips after real train steps, keep policy, killed saves,
other meshes, two processes, and the errors a person sees.

The Horizon model is `tiny_sharded` (a Gated DSA + dense FFN layer and a Delta
+ MoE layer, so the MoE RouterBias is in the checkpoint), built once per
module on mesh (1, 1, 8, 1) and trained with the real `jit_train_step`.
Everything else uses the small `Small` stand-in of tests/_checkpoint_child.py.
"""

import ast
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jax
import ml_collections
import numpy as np
import pytest
from etils import epath
from flax import nnx

from configs import horizon
from model.config import ModelConfig
from model.decoder import Horizon
from sharding import mesh as mesh_lib
from sharding import rules as rules_lib
from sharding.state import create_sharded_model, shard_model
from tests._checkpoint_child import Small, small_values
from tests.helpers import child_xla_flags, isolation_unavailable
from training import byte_corpus
from training import checkpoint as ck
from training.train_step import TrainConfig, jit_train_step, make_optimizer

ROOT = Path(__file__).resolve().parents[1]


def _mesh(shape, devices=None):
  return mesh_lib.make_mesh(dict(zip(mesh_lib.MESH_AXES, shape, strict=True)), devices=devices)


def _host(tree):
  return jax.tree.map(lambda a: np.array(a), tree)


def _assert_bitwise(actual, expected, what):
  flat_a, flat_e = ck._flat(_host(actual)), ck._flat(expected)
  assert sorted(flat_a) == sorted(flat_e), what
  for k in flat_e:
    assert flat_a[k].dtype == flat_e[k].dtype and np.array_equal(flat_a[k], flat_e[k]), f"{what}: {k}"


def _perturb(module):
  """Moves every float Variable of `module` off its value (so a restore has work to do)."""
  nnx.update(module, jax.tree.map(
      lambda a: a + 1 if jax.numpy.issubdtype(a.dtype, jax.numpy.floating) else a, nnx.state(module)))


def _differs(tree, expected) -> bool:
  a, e = ck._flat(_host(tree)), ck._flat(expected)
  return any(not np.array_equal(a[k], e[k]) for k in e)


# ---- one real training run, saved at step 2 ---------------------------------------


@pytest.fixture(scope="module")
def config():
  c = horizon.get_config("tiny_sharded")
  c.train.update(global_batch=8, seq_len=16)
  return c


@pytest.fixture(scope="module")
def run(config, tmp_path_factory):
  """2 real steps, an async save of step 2, then a 3rd step that donates the saved buffers."""
  cfg = ModelConfig.from_config(config.model)
  tc = TrainConfig.from_config(config.train)
  mesh = _mesh((1, 1, 8, 1))
  corpus = byte_corpus.load_stdlib_bytes(1 << 20)
  directory = tmp_path_factory.mktemp("ckpt") / "run"
  rng = jax.random.key(11)
  data_state = {"mix": {"stdlib": [3, 14]}, "remainder_slices": {"inputs": [-1, -1]}, "epoch": 2}
  with mesh_lib.activate(mesh):
    model = create_sharded_model(lambda: Horizon(cfg, rngs=nnx.Rngs(5)), mesh)
    optimizer = nnx.Optimizer(model, make_optimizer(tc), wrt=nnx.Param)
    ckpt = ck.Checkpointer(str(directory), every=2, keep=3)
    started = []
    for step in range(3):
      batch = byte_corpus.global_batch(mesh, tc.global_batch, tc.seq_len,
                                       lambda rows, s=step: byte_corpus.lm_rows(corpus, 0, s, rows, 16))
      jax.block_until_ready(jit_train_step(model, optimizer, batch, tc))
      started.append(ckpt.save(step + 1, model=model, optimizer=optimizer, data_state=data_state,
                               rng=rng, config=config))
      if step == 1:  # snapshot what step 2 saved; the next step donates these buffers
        saved = {"params": _host(ck.model_tree(model)), "opt": _host(ck.optimizer_tree(optimizer))}
    ckpt.wait()
  return {"cfg": cfg, "tc": tc, "mesh": mesh, "dir": directory, "ckpt": ckpt, "model": model,
          "optimizer": optimizer, "saved": saved, "started": started, "rng": rng,
          "data_state": data_state, "config": config}


def test_round_trip_after_train_steps_is_bitwise(run):
  assert run["started"] == [False, True, False]  # every=2: only step 2
  assert run["ckpt"].all_steps() == [2]
  model, optimizer = run["model"], run["optimizer"]
  assert _differs(ck.model_tree(model), run["saved"]["params"])  # step 3 moved on
  before = jax.tree.map(lambda a: a.sharding, ck.model_tree(model))
  with ck.Checkpointer(str(run["dir"]), every=2, keep=3) as fresh:  # as after a restart
    assert fresh.latest_step() == 2
    meta = fresh.restore(model=model, optimizer=optimizer)
  _assert_bitwise(ck.model_tree(model), run["saved"]["params"], "params")
  _assert_bitwise(ck.optimizer_tree(optimizer), run["saved"]["opt"], "optimizer state")
  assert int(optimizer.step[...]) == 2
  assert jax.tree.map(lambda a: a.sharding, ck.model_tree(model)) == before
  assert meta["step"] == 2 and meta["format_version"] == ck.FORMAT_VERSION
  assert meta["data_state"] == run["data_state"]
  assert np.array_equal(jax.random.key_data(meta["rng"]), jax.random.key_data(run["rng"]))
  assert jax.random.key_impl(meta["rng"]) == jax.random.key_impl(run["rng"])
  assert meta["config"] == json.loads(json.dumps(run["config"].to_dict()))
  assert ml_collections.ConfigDict(meta["config"]).model.vocab_size == 332


def test_router_bias_is_saved(run):
  flat = ck._flat(run["saved"]["params"])
  bias = flat["blocks/1/ffn/router_bias"]
  assert bias.shape == (run["cfg"].num_experts,) and np.any(bias != 0)  # moved by 2 steps


def test_restore_onto_other_meshes_and_one_device(run):
  """Saved on (1,1,8,1); restored on (2,2,2,1), on one device, and abstractly via load_model."""
  other = _mesh((2, 2, 2, 1))
  with mesh_lib.activate(other):
    target = shard_model(run["model"], other)
    optimizer = nnx.Optimizer(target, make_optimizer(run["tc"]), wrt=nnx.Param)
  _perturb(target)
  assert _differs(ck.model_tree(target), run["saved"]["params"])
  assert _differs(ck.optimizer_tree(optimizer), run["saved"]["opt"])
  want = jax.tree.map(lambda a: a.sharding, (ck.model_tree(target), ck.optimizer_tree(optimizer)))
  assert ck.model_tree(target)["embed"].sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
  ck.Checkpointer(str(run["dir"]), every=2, keep=3).restore(model=target, optimizer=optimizer)
  got = jax.tree.map(lambda a: a.sharding, (ck.model_tree(target), ck.optimizer_tree(optimizer)))
  assert got == want
  _assert_bitwise(ck.model_tree(target), run["saved"]["params"], "params on (2,2,2,1)")
  _assert_bitwise(ck.optimizer_tree(optimizer), run["saved"]["opt"], "opt state on (2,2,2,1)")

  one = _mesh((1, 1, 1, 1), devices=jax.devices()[3:4])
  single = shard_model(run["model"], one)
  _perturb(single)
  ck.restore_params(str(run["dir"]), single)
  _assert_bitwise(ck.model_tree(single), run["saved"]["params"], "params on one device")
  assert all(a.sharding.device_set == {jax.devices()[3]} for a in jax.tree.leaves(ck.model_tree(single)))

  loaded = ck.load_model(str(run["dir"]), run["cfg"])  # abstract model, first local device
  _assert_bitwise(ck.model_tree(loaded), run["saved"]["params"], "load_model, one device")
  assert all(a.sharding.device_set == {jax.local_devices()[0]}
             for a in jax.tree.leaves(ck.model_tree(loaded)))
  loaded = ck.load_model(str(run["dir"]), run["cfg"], mesh=other)
  _assert_bitwise(ck.model_tree(loaded), run["saved"]["params"], "load_model on (2,2,2,1)")
  _, abstract = nnx.split(nnx.eval_shape(lambda: Horizon(run["cfg"], rngs=nnx.Rngs(0))))
  rule = nnx.to_pure_dict(rules_lib.state_shardings(abstract, other))
  assert jax.tree.map(lambda a: a.sharding, ck.model_tree(loaded)) == rule


def test_wrong_config_names_param_and_shapes(run, tiny_cfg):
  with pytest.raises(ck.CheckpointError, match=r"different config") as e:
    ck.load_model(str(run["dir"]), tiny_cfg)  # 4 layers vs 2
  assert "blocks/2/" in str(e.value) and "in the model but not the checkpoint" in str(e.value)
  wider = run["cfg"].replace(vocab_size=334, image_token_id=333)
  with pytest.raises(ck.CheckpointError) as e:
    ck.load_model(str(run["dir"]), wider)
  msg = str(e.value)
  assert "params embed has shape (332, 56) in the checkpoint but (334, 56) in the model" in msg
  assert "the checkpoint was written for a different config" in msg and "step 2" in msg


def test_read_meta_without_arrays(run):
  meta = ck.read_meta(str(run["dir"]))
  assert meta["step"] == 2 and meta["data_state"] == run["data_state"]
  assert meta["config"]["variant"] == "tiny_sharded" and meta["process_count"] == 1
  with pytest.raises(ck.CheckpointNotFoundError, match=r"no checkpoint for step 7 .* steps: \[2\]"):
    ck.read_meta(str(run["dir"]), step=7)


# ---- keep policy, interval, meta, errors (Small model) -----------------------------------


def test_keep_policy_interval_and_force(tmp_path):
  with ck.Checkpointer(tmp_path / "a", every=1, keep=2, async_save=True) as c:
    for step in range(1, 6):
      assert c.save(step, model=Small(step))
    c.wait()
    assert c.all_steps() == [4, 5] and c.latest_step() == 5
    assert not c.save(5, model=Small(0), force=True)  # a committed step is never rewritten
  assert sorted(p.name for p in (tmp_path / "a").iterdir() if p.name.isdigit()) == ["4", "5"]
  target = Small(0)
  assert ck.restore_params(tmp_path / "a", target, step=4)["step"] == 4
  _assert_bitwise(ck.model_tree(target), small_values(4), "step 4")
  with ck.Checkpointer(tmp_path / "b", every=3, keep=5, async_save=False) as c:
    assert [c.save(s, model=Small(s)) for s in range(1, 7)] == [False, False, True] * 2
    assert c.save(7, model=Small(7), force=True) and c.all_steps() == [3, 6, 7]


def test_meta_round_trips_raw_key_and_dataclass_config(tmp_path):
  raw = jax.random.PRNGKey(123)
  cfg = ModelConfig.from_config(horizon.get_config("tiny").model)
  with ck.Checkpointer(tmp_path, every=1, keep=1) as c:
    c.save(4, model=Small(1), rng=raw, config=cfg, data_state=None)
  meta = ck.read_meta(tmp_path)
  assert meta["rng"].dtype == np.uint32 and np.array_equal(meta["rng"], raw)
  assert meta["config"]["vocab_size"] == 331 and meta["data_state"] is None
  with ck.Checkpointer(tmp_path / "x", every=1, keep=1) as c:
    with pytest.raises(ck.CheckpointError, match=r"config.bad=<object .* cannot be stored as JSON"):
      c.save(1, model=Small(1), config={"bad": object()})
    assert c.all_steps() == []


def test_errors_name_the_problem(tmp_path):
  empty = ck.Checkpointer(tmp_path / "empty", every=1, keep=1)
  assert empty.latest_step() is None
  with pytest.raises(ck.CheckpointNotFoundError, match=r"no checkpoint in .*empty: it holds no"):
    empty.restore(model=Small(0))
  with pytest.raises(ck.CheckpointNotFoundError, match=r"no checkpoint in .*nowhere: the directory"):
    ck.restore_params(tmp_path / "nowhere", Small(0))
  with pytest.raises(ck.CheckpointError, match=r"every=0 must be a positive int"):
    ck.Checkpointer(tmp_path / "e", every=0, keep=1)
  with pytest.raises(ck.CheckpointError, match=r"step=-1 must be a non-negative int"):
    empty.save(-1, model=Small(0))
  model = Small(1)
  optimizer = nnx.Optimizer(model, make_optimizer(TrainConfig.from_config(
      horizon.get_config("tiny").train)), wrt=nnx.Param)
  empty.save(1, model=model)  # no optimizer saved
  empty.wait()
  with pytest.raises(ck.CheckpointError, match=r"item 'opt_state' is missing.*optimizer=None"):
    empty.restore(model=model, optimizer=optimizer)
  empty.close()


def _two_steps(directory):
  tc = TrainConfig.from_config(horizon.get_config("tiny").train)
  with ck.Checkpointer(directory, every=1, keep=3) as c:
    for step in (1, 2):
      model = Small(step)
      c.save(step, model=model, optimizer=nnx.Optimizer(model, make_optimizer(tc), wrt=nnx.Param))


def test_a_damaged_step_is_named_with_the_way_back(tmp_path):
  """Damaged files of the newest step: readers that do not need them still work; the others get
  a CheckpointError naming the step and the earlier one to use (they raised TensorStore's or json's
  own error, 2 KB of spec, or a bare KeyError / AttributeError)."""
  d = tmp_path / "run"
  _two_steps(d)
  for f in (d / "2" / "opt_state" / "d").iterdir():  # the optimizer state: read_meta / serving
    f.write_bytes(b"")                                 # never read it (they opened every array)
  assert ck.read_meta(d)["step"] == 2
  model = Small(0)
  ck.restore_params(d, model)
  _assert_bitwise(ck.model_tree(model), small_values(2), "params of step 2")
  way = (rf"step 2 is damaged: reading .* failed \(.*\); move {d}/2 aside to use step 1 "
         r"\(finalized steps: \[1, 2\]\)")
  with ck.Checkpointer(d, every=1, keep=3) as c:
    with pytest.raises(ck.CheckpointError, match=way):
      c.restore(model=model, optimizer=nnx.Optimizer(model, make_optimizer(TrainConfig.from_config(
          horizon.get_config("tiny").train)), wrt=nnx.Param))
  for f in (d / "2" / "params" / "d").iterdir():
    f.write_bytes(f.read_bytes()[:7])  # truncated
  with pytest.raises(ck.CheckpointError, match=way) as e:
    ck.restore_params(d, model)
  assert len(str(e.value)) < 900, str(e.value)
  ck.restore_params(d, model, step=1)
  _assert_bitwise(ck.model_tree(model), small_values(1), "params of step 1")
  (d / "2" / "params" / "_METADATA").unlink()
  with pytest.raises(ck.CheckpointError, match=r"reading item 'params'.s metadata failed.*use step 1"):
    ck.restore_params(d, model)
  meta = d / "2" / "meta" / "metadata"
  good = json.loads(meta.read_text())
  for bad, says in (("[1, 2]", "a JSON object was expected, got list"),
                    ('{"format_version": 1}', r"format_version=1, step=None \(ints expected"),
                    (json.dumps({**good, "rng": {"data": [1]}}), r"rng=\{'data': \[1\]\}.*KeyError"),
                    (json.dumps(good)[:40], r"reading items \['meta'\] failed \(JSONDecodeError")):
    meta.write_text(bad)
    with pytest.raises(ck.CheckpointError, match=says):
      ck.read_meta(d)
  for bad in (True, "2", 1.0):
    with pytest.raises(ck.CheckpointError, match=r"step=.* must be an int \(finalized steps: \[1, 2\]\)"):
      ck.restore_params(d, model, step=bad)
  (d / "3").mkdir()  # a numeric directory a copy left empty
  with pytest.raises(ck.CheckpointError, match=rf"step 3 is damaged: .*{d}/3 is empty .*use step 2"):
    ck.read_meta(d)


def test_a_file_or_read_only_directory_is_refused_before_training(tmp_path):
  """Checkpointer on a file, or on a directory it cannot write, failed at the first save (after
  `every` steps of training) with a raw OSError; readers called a file 'no finalized step'."""
  (tmp_path / "f").write_text("x")
  with pytest.raises(ck.CheckpointError, match=r"directory .*/f is a file; move it aside"):
    ck.Checkpointer(tmp_path / "f", every=1, keep=1)
  with pytest.raises(ck.CheckpointError, match=r"directory .*/f is a file; pass the directory"):
    ck.read_meta(tmp_path / "f")
  ro = tmp_path / "ro"
  ro.mkdir()
  if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                                         capture_output=True).returncode:
    isolation_unavailable("a read-only mount needs root (root writes through file permissions)")
  try:
    with pytest.raises(ck.CheckpointError, match=r"directory .*/ro is not writable \(Read-only file sys"):
      ck.Checkpointer(ro, every=1, keep=1)
  finally:
    # Lazily, as rl/sandbox/taskdir.py does: a plain umount failed once in CI with "target is busy"
    # (the other xdist worker was running nsjail sandboxes, whose namespaces copy the mount table).
    subprocess.run(["umount", "-l", str(ro)], check=True)


def test_one_data_state_for_every_process_resumes_on_any_count(caplog):
  """A state stored alike by every process (bytes, SFT, RL's sampler) resumes exactly on another
  process count (it came back None, and each pipeline then raised a wrong reason); per-process
  (grain) states restart, with a warning."""
  meta = ck.make_meta(3, None, jax.random.key(0), {})
  shared = {"pipeline": "bytes", "seed": 4}
  for states, want in (([shared] * 2, shared), ([{"a": 1}, {"a": 2}], None)):
    got = ck.read_meta_dict({**meta, "data_states": states}, "ckpt")
    assert got["data_state"] == want and got["process_count"] == 2
  assert "restarts instead of resuming exactly" in caplog.text


def test_rng_keys_of_every_impl_round_trip_through_meta():
  """The key's impl is stored with its data: a mutant that ignored it on restore passed every test
  (they used the default threefry key, whose data shape is the default's)."""
  for key in (jax.random.key(11), jax.random.key(11, impl="rbg"), jax.random.key(11, impl="unsafe_rbg")):
    meta = json.loads(json.dumps(ck.make_meta(1, None, key, {})))
    back = ck.read_meta_dict(meta, "ckpt")["rng"]
    assert jax.random.key_impl(back) == jax.random.key_impl(key)
    np.testing.assert_array_equal(jax.random.key_data(back), jax.random.key_data(key))


def test_no_local_only_file_calls():
  """Directories may be URLs: the module must do all file I/O through epath / orbax."""
  source = "\n".join((ROOT / "training" / f).read_text() for f in ("checkpoint.py", "checkpoint_meta.py"))
  tree = ast.parse(source)
  imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
              for a in n.names}
  imported |= {n.module.split(".")[0] for n in ast.walk(tree)
               if isinstance(n, ast.ImportFrom) and n.module}
  assert not imported & {"os", "pathlib", "shutil", "glob", "io", "tempfile"}, imported
  calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
  assert "open" not in calls
  # Object stores get orbax's commit-file protocol (no atomic rename there); local paths rename.
  for url in ("s3://bucket/run", "gs://bucket/run"):
    assert ck._atomicity(epath.Path(url)).mode == ck.ocp.options.AtomicityMode.COMMIT_FILE
  assert ck._atomicity(epath.Path("/tmp/run")) is None


# ---- (b) a save killed half-way ---------------------------------------------------------


def _env(devices):
  env = dict(os.environ)
  env.update(XLA_FLAGS=child_xla_flags(devices), JAX_PLATFORMS="cpu")
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(k, None)
  return env


def _child(*args, devices=1):
  return subprocess.Popen([sys.executable, "-m", "tests._checkpoint_child", *map(str, args)],
                          cwd=ROOT, env=_env(devices), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)


@pytest.mark.parametrize("where", ["write", "commit"])
def test_save_killed_midway_leaves_previous_checkpoint(tmp_path, where):
  proc = _child("kill", tmp_path, where)
  try:
    line = proc.stdout.readline()  # blocks until step 2 is stuck mid-save (or the child died)
    assert line.strip() == "READY", proc.stderr.read()[-3000:]
    os.kill(proc.pid, signal.SIGKILL)
  finally:
    proc.kill()
    proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  names = sorted(p.name for p in tmp_path.iterdir())
  assert "1" in names and "2" not in names and any(n.startswith("2.orbax-checkpoint-tmp") for n in names)
  assert ck.read_meta(tmp_path)["step"] == 1  # readers ignore the unfinished step
  with ck.Checkpointer(tmp_path, every=1, keep=5) as c:
    assert c.latest_step() == 1 and c.all_steps() == [1]
    target = Small(0)
    meta = c.restore(model=target)
    assert meta["step"] == 1 and meta["data_state"] == {"pos": 1}
    _assert_bitwise(ck.model_tree(target), small_values(1), "step 1 after the kill")
    assert c.save(2, model=Small(2), data_state={"pos": 2})
    c.wait()
    assert c.all_steps() == [1, 2]
    c.restore(model=target)
    _assert_bitwise(ck.model_tree(target), small_values(2), "step 2 saved again")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]


# ---- two processes ----------------------------------------------------------------------


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_save_own_data_state_and_restore_on_one(tmp_path):
  port = _free_port()
  procs = [_child("multihost", tmp_path, f"127.0.0.1:{port}", i, devices=2) for i in range(2)]
  results = []
  for p in procs:
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    results.append(json.loads([line for line in out.splitlines() if line.startswith("{")][-1]))
  for i, r in enumerate(results):
    assert r == {"process": i, "data_state": {"process": i, "pos": [i, 5]}, "step": 3,
                 "process_count": 2, "w_equal": True, "bias_equal": True}
  # One process reads the 2-process checkpoint: arrays fine, no data state to resume from.
  target = Small(0)
  meta = ck.restore_params(tmp_path, target)
  assert meta["process_count"] == 2 and meta["data_state"] is None
  _assert_bitwise(ck.model_tree(target), small_values(7), "2-process checkpoint on 1 process")
