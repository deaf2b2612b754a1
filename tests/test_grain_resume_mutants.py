"""GrainBatches resume and seed checks that an audit found missing: a resume under another
config.data.shuffle_seed / packing / seq_len / source mixture was accepted silently (documents
repeated or skipped) or failed with a raw KeyError; a bad shuffle_seed prepared the data and started
the pipeline, then failed at the first batch."""

import json
import types

import jax
import numpy as np
import pytest

from configs import pretrain
from model.config import ConfigError
from sharding import mesh as mesh_lib
from training import batches
from training.data_sources import DataError
from training.train_step import TrainConfig


@pytest.mark.parametrize("seed", [-1, 0.5, True, "0"])
def test_a_bad_shuffle_seed_is_refused_before_any_data_work(monkeypatch, tmp_path, seed):
  def no_data_work(*args, **kwargs):
    raise AssertionError("data work started before shuffle_seed was checked")

  monkeypatch.setattr(batches, "tokenizer_for", no_data_work)
  monkeypatch.setattr(batches, "prepare_data", no_data_work)
  # a type-safe ConfigDict only lets -1 and True through; a dict config (e.g. rebuilt from JSON) takes any
  data = {**pretrain.get_config("tiny").data.to_dict(), "shuffle_seed": seed}
  config = types.SimpleNamespace(data=types.SimpleNamespace(**data))
  match = rf"config.data.shuffle_seed={seed!r}: the grain pipeline needs an int >= 0"
  with pytest.raises(ConfigError, match=match):
    batches.GrainBatches(config, str(tmp_path), None, None)
  assert not list(tmp_path.iterdir())


def _fake(seed=0, packing="concat", seq_len=32, sources="stdlib=1.0", weights=None):
  """A GrainBatches with a recording iterator and no data (the settings come from config and manifest)."""
  g = object.__new__(batches.GrainBatches)
  g.config = pretrain.get_config("tiny")
  g.config.data.update(shuffle_seed=seed, packing=packing, sources=sources)
  g.tc = types.SimpleNamespace(seq_len=seq_len)
  g.manifest = {"sources": {n: {"weight": w} for n, w in (weights or {"stdlib": 1.0}).items()}}
  g.restored = []
  g._it = types.SimpleNamespace(get_state=lambda: {"parent": {"next_index": 7}, "next_row": 2},
                                set_state=g.restored.append)
  return g


@pytest.mark.parametrize("changed, match", [
    ({"seed": 1}, r"config.data.shuffle_seed=0, this run 1; resume with --config.data.shuffle_seed=0,"),
    ({"packing": "first_fit"},
     r"config.data.packing='concat', this run 'first_fit'; resume with --config.data.packing='concat',"),
    ({"seq_len": 64}, r"config.train.seq_len=32, this run 64; resume with --config.train.seq_len=32,"),
    ({"sources": "stdlib=1.0;text:/d/*.txt=1", "weights": {"stdlib": 1.0, "text": 1.0}},
     r"config.data.sources='stdlib=1.0', this run .*resume with --config.data.sources='stdlib=1.0',"),
    ({"weights": {"stdlib": 0.5}}, r"weights \{'stdlib': 1.0\}, this run's prepared data has "
                                   r"\{'stdlib': 0.5\}; resume with --config.data.sources='stdlib=1.0'"),
])
def test_a_resume_under_other_stream_settings_is_refused(changed, match):
  state = json.loads(json.dumps(_fake().get_state()))  # as the checkpoint's JSON meta holds it
  resumed = _fake(**changed)
  with pytest.raises(DataError, match=match):
    resumed.set_state(state)
  assert resumed.restored == []  # refused before the iterator was touched


def test_the_same_settings_and_a_bare_legacy_state_resume():
  state = json.loads(json.dumps(_fake().get_state()))
  assert state["pipeline"] == "grain" and state["settings"]["shuffle_seed"] == 0
  g = _fake()
  g.set_state(state)
  g.set_state({"parent": {"next_index": 3}})  # an older checkpoint: the iterator state alone
  assert g.restored == [{"parent": {"next_index": 7}, "next_row": 2}, {"parent": {"next_index": 3}}]


def test_a_real_grain_resume_continues_exactly_or_names_the_changed_setting(tmp_path):
  docs = tmp_path / "docs"
  docs.mkdir()
  for i in range(8):
    (docs / f"{i}.txt").write_text(f"document {i} " + "alpha bravo kilo lima " * (i + 2))

  def make(seed=0, packing="concat"):
    c = pretrain.get_config("tiny")
    c.data.update(sources=f"text:{docs}/*.txt=1", prepared_dir=str(tmp_path / "data"),
                  shuffle_seed=seed, packing=packing)
    c.train.global_batch, c.train.seq_len = 2, 16
    mesh = mesh_lib.make_mesh({"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}, jax.devices()[:1])
    g = batches.GrainBatches(c, str(tmp_path), mesh, TrainConfig.from_config(c.train))
    g.start()
    return g

  a = make()
  for s in range(3):
    a.batch(s)
  state = json.loads(json.dumps(a.get_state()))
  want = np.asarray(a.batch(3)["inputs"])
  b = make()
  b.set_state(state)
  np.testing.assert_array_equal(np.asarray(b.batch(3)["inputs"]), want)
  with pytest.raises(DataError, match="resume with --config.data.shuffle_seed=0"):
    make(seed=1).set_state(state)
  with pytest.raises(DataError, match="resume with --config.data.packing='concat'"):
    make(packing="first_fit").set_state(state)
