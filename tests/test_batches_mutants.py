"""training/batches.py and training/byte_corpus.py edge cases that mutation testing found unpinned:
the byte corpus's window offsets and length, the byte vocabulary bound, a bytes checkpoint given
to the grain pipeline, and the per-process share of the global batch."""

import types

import jax
import numpy as np
import pytest

from configs import pretrain
from training import batches, byte_corpus
from training.data_sources import DataError


def test_lm_rows_match_a_reference_window():
  rng = np.random.default_rng(3)
  corpus = rng.integers(0, 256, 97).astype(np.uint8)
  seed, step, seq_len, rows = 5, 11, 13, np.array([0, 4, 9])
  got = byte_corpus.lm_rows(corpus, seed, step, rows, seq_len)
  for i, r in enumerate(rows):
    # The offset drawn for (seed, step, row): uniform over every window of seq_len + 1 bytes but the last.
    start = np.random.default_rng((seed, step, int(r))).integers(0, 97 - 13 - 1)
    window = corpus[start:start + 14].astype(np.int32)
    np.testing.assert_array_equal(got["inputs"][i], window[:-1])
    np.testing.assert_array_equal(got["targets"][i], window[1:])
  np.testing.assert_array_equal(got["positions"], np.tile(np.arange(13), (3, 1)))
  np.testing.assert_array_equal(got["segment_ids"], np.ones((3, 13)))


def test_stdlib_bytes_are_exactly_max_bytes():
  corpus = byte_corpus.load_stdlib_bytes(1 << 17)
  assert corpus.shape == (1 << 17,) and corpus.dtype == np.uint8


def test_byte_pipeline_needs_256_ids():
  config = pretrain.get_config("tiny")
  config.data.pipeline = "bytes"
  with pytest.raises(ValueError, match="vocab_size=255: config.data.pipeline='bytes' needs >= 256"):
    batches.ByteBatches(config, types.SimpleNamespace(vocab_size=255), None, None)
  assert batches.ByteBatches(config, types.SimpleNamespace(vocab_size=256), None, None).seed == \
      config.data.shuffle_seed


def test_grain_batches_refuse_a_bytes_checkpoint_and_forward_their_own():
  g = object.__new__(batches.GrainBatches)
  got = []
  g._it = types.SimpleNamespace(set_state=got.append)
  with pytest.raises(DataError, match="written with config.data.pipeline='bytes'"):
    g.set_state({"pipeline": "bytes", "seed": 0})
  g.set_state({"parent": {"next_index": 3}, "next_row": 1})  # a bare (pre-settings) iterator state
  assert got == [{"parent": {"next_index": 3}, "next_row": 1}]
  g.config, g.tc = pretrain.get_config("tiny"), types.SimpleNamespace(seq_len=32)
  g.manifest = {"sources": {"stdlib": {"weight": 1.0}}}
  g._it.get_state = lambda: {"parent": {"next_index": 5}}
  state = g.get_state()
  assert state["pipeline"] == "grain" and state["iterator"] == {"parent": {"next_index": 5}}
  g.set_state(state)  # its own state: the settings agree, the iterator state is forwarded
  assert got[-1] == {"parent": {"next_index": 5}}


@pytest.mark.parametrize("processes, share", [(1, 12), (3, 4), (4, 3), (5, None), (8, None)])
def test_each_process_loads_its_share_of_the_global_batch(monkeypatch, processes, share):
  monkeypatch.setattr(jax, "process_count", lambda: processes)
  tc = types.SimpleNamespace(global_batch=12)
  if share is None:
    with pytest.raises(ValueError, match=f"global_batch=12 is not divisible by the {processes} processes"):
      batches._local_batch(tc)
  else:
    assert batches._local_batch(tc) == share
