"""Mutation audit of training/batch_checks.py, training/knobs.py and training/tolerance.py: each rule
of a packed batch, each knob range and the tolerance helper, on hand-written inputs."""

import numpy as np
import pytest

from model.config import ConfigError
from training import knobs, tolerance
from training.batch_checks import check_batch
from training.data_sources import DataError

EOS = 9


def _batch(**rows):
  """One row: 'a b c | d e' (segments 1 and 2, eos ending segment 1) then one padding token."""
  b = {"inputs": [[4, 5, 6, 7, 8, 0]], "targets": [[5, 6, EOS, 8, 3, 0]], "positions": [[0, 1, 2, 0, 1, 0]],
       "segment_ids": [[1, 1, 1, 2, 2, 0]], "loss_mask": [[1, 1, 1, 1, 1, 0]]}
  b.update(rows)
  return {k: np.asarray(v, np.float32 if k == "loss_mask" else np.int32) for k, v in b.items()}


def test_a_consistent_batch_passes():
  check_batch(_batch(), EOS)
  check_batch(_batch(), EOS, docs_end_in_row=True)
  check_batch(_batch(segment_ids=[[0] * 6], loss_mask=[[0] * 6]), EOS)  # an all-padding row


@pytest.mark.parametrize("change,match", [
    ({"segment_ids": [[1, 1, 1, 0, 2, 0]], "loss_mask": [[1, 1, 1, 0, 1, 0]]}, "padding .* before real"),
    ({"loss_mask": [[1, 1, 1, 1, 0, 0]]}, "loss_mask is not 1 exactly"),
    ({"loss_mask": [[1, 1, 1, 1, 1, 1]]}, "loss_mask is not 1 exactly"),
    ({"positions": [[0, 1, 2, 3, 4, 0]]}, r"positions \[0, 1, 2, 3, 4\] do not restart"),
    ({"positions": [[1, 2, 3, 0, 1, 0]]}, "do not restart"),
    ({"positions": [[0, 1, 1, 0, 1, 0]]}, "do not restart"),
    ({"targets": [[5, 7, EOS, 8, 3, 0]]}, "not the next input token"),
    ({"inputs": [[4, 5, 6, 7, EOS, 0]], "targets": [[5, 6, EOS, EOS, 3, 0]]},
     r"eos \(9\) appears as an input"),
    ({"targets": [[5, EOS, EOS, 8, 3, 0]], "inputs": [[4, 5, EOS, 7, 8, 0]]}, "appears as an input"),
    ({"targets": [[EOS, 6, EOS, 8, 3, 0]], "inputs": [[4, EOS, 6, 7, 8, 0]]}, "appears as an input"),
])
def test_each_rule_refuses_its_violation(change, match):
  with pytest.raises(DataError, match="^batch row 0: (.*)?" + match):
    check_batch(_batch(**change), EOS)


def test_eos_rules():
  # Segment 1 ends inside the row predicting 6, not eos: only concat packing requires eos there.
  b = _batch(targets=[[5, 6, 1, 8, 3, 0]])
  check_batch(b, EOS)
  with pytest.raises(DataError, match="a segment ends inside the row without predicting eos"):
    check_batch(b, EOS, docs_end_in_row=True)
  # The row's last segment may run on past the row (its target is the next token, not eos).
  check_batch(_batch(targets=[[5, 6, EOS, 8, 3, 0]]), EOS, docs_end_in_row=True)


def test_eos_id_zero_is_checked():
  """Token 0 as eos (not 'no eos'): it may not be an input."""
  with pytest.raises(DataError, match=r"eos \(0\) appears as an input"):
    check_batch(_batch(inputs=[[4, 0, 6, 7, 8, 0]], targets=[[0, 6, EOS, 8, 3, 0]]), 0)


def test_shapes_keys_and_dtypes_are_refused_by_name():
  b = _batch()
  del b["loss_mask"]
  with pytest.raises(DataError, match=r"batch lacks \['loss_mask'\]"):
    check_batch(b)
  with pytest.raises(DataError, match=r"batch\['targets'\] has shape \(1, 5\); all must be \[batch, seq\]"):
    check_batch(_batch(targets=[[5, 6, EOS, 8, 3]]))
  flat = {k: v[0] for k, v in _batch().items()}
  with pytest.raises(DataError, match=r"batch\['inputs'\] has shape \(6,\)"):
    check_batch(flat)
  with pytest.raises(DataError, match=r"batch\['inputs'\] has dtype float32; it must be an integer dtype"):
    check_batch({**_batch(), "inputs": _batch()["inputs"].astype(np.float32)})
  check_batch({**_batch(), "loss_mask": _batch()["loss_mask"] > 0, "positions": _batch()["positions"].astype(
      np.int64)})  # a bool mask and int64 positions are fine


def test_check_int_knobs():
  cfg = {"a": 2, "b": True, "c": 0, "d": 1.0}
  knobs.check_int_knobs("s", cfg, [("a", 2, "")])
  for name, low, why, msg in (("b", 0, "", "config.s.b=True: must be an int >= 0."),
                              ("c", 1, "why", "config.s.c=0: must be an int >= 1 (why)."),
                              ("d", 1, "", "config.s.d=1.0: must be an int >= 1."),
                              ("e", 0, "", "config.s.e=None: must be an int >= 0.")):
    with pytest.raises(ConfigError) as e:
      knobs.check_int_knobs("s", cfg, [(name, low, why)])
    assert str(e.value) == msg


def test_check_nonnegative_numbers():
  knobs.check_nonnegative_numbers("s", {"a": 0, "b": 2.5}, ("a", "b"))
  for value in (-1e-9, float("inf"), float("nan"), True, "1"):
    with pytest.raises(ConfigError, match=r"^config.s.x=.*: must be a finite number >= 0.$"):
      knobs.check_nonnegative_numbers("s", {"x": value}, ("x",))


def test_tolerance_helpers():
  assert tolerance.rel_err([3.0, 4.0], [0.0, 0.0]) == 5.0 / 1e-30
  assert tolerance.rel_err([1.0, 2.0], [1.0, 1.0]) == pytest.approx(1 / np.sqrt(2))
  assert tolerance.RTOL == {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}
  tolerance.assert_close([1.0, 1.0 + 1e-5], [1.0, 1.0])  # error 1e-5 / sqrt(2) <= 1e-5
  with pytest.raises(AssertionError, match="relative error"):
    tolerance.assert_close([1.0, 1.0 + 2e-5], [1.0, 1.0])
  tolerance.assert_close([1.0, 1.01], [1.0, 1.0], dtype="bfloat16")
  tolerance.assert_close([2.0], [1.0], rtol=1.0)  # error exactly the tolerance passes
  with pytest.raises(AssertionError, match="x: shape"):
    tolerance.assert_close(np.ones((1, 2)), np.ones(2), what="x")
  with pytest.raises(AssertionError, match="non-finite"):
    tolerance.assert_close([np.nan, 1.0], [1.0, 1.0], rtol=np.inf)
