"""training/checkpoint_meta.py edge cases a mutation audit found unpinned: JSON conversion of keys,
numpy scalars and arrays, a damaged rng or data_states list, and a meta without a config."""

import dataclasses

import jax
import numpy as np
import pytest

from training import checkpoint_meta as cm


@dataclasses.dataclass
class _Plain:
  n: int


def test_keys_become_strings_and_numpy_scalars_plain_values():
  """Keys are stored as strings, as JSON has them (a mutant kept an int and a tuple key: the tuple
  failed only when the checkpoint was written); a numpy step is a plain int."""
  meta = cm.make_meta(np.int64(3), {7: np.float32(0.5)}, None, {1: "a", (2, 3): np.bool_(True), "f": 0.25})
  assert meta["config"] == {"1": "a", "(2, 3)": True, "f": 0.25}
  assert meta["data_states"] == [{"7": 0.5}]
  assert type(meta["step"]) is int and meta["step"] == 3
  assert type(meta["config"]["(2, 3)"]) is bool


@pytest.mark.parametrize("value, words", [
    (np.array([1, 2]), r"data_state=array\(\[1, 2\]\) \(ndarray\) cannot be stored as JSON"),
    (_Plain, r"data_state=<class .*_Plain'> \(type\) cannot be stored as JSON")])
def test_an_array_or_a_dataclass_type_is_refused_naming_it(value, words):
  """A 0-d array is a scalar; a 1-d one is refused like any other object (a mutant called .item() on
  it: a bare ValueError), and so is a dataclass *type* (a mutant called asdict on it)."""
  assert cm.make_meta(1, np.array(4), None, {})["data_states"] == [4]
  with pytest.raises(cm.CheckpointError, match=words):
    cm.make_meta(1, value, None, {})
  assert cm.make_meta(1, _Plain(2), None, {})["data_states"] == [{"n": 2}]


@pytest.mark.parametrize("rng", [{"impl": None, "data": [-1, 0]}, {"impl": None, "data": [2 ** 32, 0]}])
def test_rng_data_out_of_uint32_range_is_a_damaged_meta(rng):
  meta = cm.make_meta(1, None, None, {})
  with pytest.raises(cm.CheckpointError, match=r"ckpt: item 'meta' is damaged: rng=.*OverflowError"):
    cm.read_meta_dict({**meta, "rng": rng}, "ckpt")


def test_a_raw_key_comes_back_uint32():
  meta = cm.make_meta(1, None, jax.random.PRNGKey(5), {})
  back = cm.read_meta_dict(meta, "ckpt")["rng"]
  assert back.dtype == np.uint32
  np.testing.assert_array_equal(back, [0, 5])


@pytest.mark.parametrize("states", [[], None])
def test_empty_or_null_data_states_read_as_one_process_without_state(states):
  """(A mutant read [] as a list to index, and None as a damaged meta.)"""
  meta = cm.make_meta(2, None, None, None)
  got = cm.read_meta_dict({**meta, "data_states": states}, "ckpt")
  assert (got["data_state"], got["process_count"], got["step"]) == (None, 1, 2)
  assert got["config"] is None  # no config stored: None, not an empty one
