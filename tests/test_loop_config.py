"""The training loop's own knobs (config.metrics, config.checkpoint, config.data.packing) are
checked before data is prepared or a model is built, and the errors name the field."""

import re

import pytest

from configs import pretrain
from training import loop


@pytest.mark.parametrize("section,field,value,message", [
    ("metrics", "log_every", 0, "config.metrics.log_every=0: must be an int >= 1"),
    ("checkpoint", "every", 0, "config.checkpoint.every=0: must be an int >= 1"),
    ("checkpoint", "keep", -1, "config.checkpoint.keep=-1: must be an int >= 1"),
    ("metrics", "peak_flops", -1.0, "config.metrics.peak_flops=-1.0: give the peak FLOP/s of one device"),
])
def test_loop_knobs_fail_before_anything_is_built(tmp_path, section, field, value, message):
  config = pretrain.get_config("tiny")
  config[section][field] = value
  built = []
  with pytest.raises(ValueError, match=re.escape(message)):
    loop._Run(config, str(tmp_path), make_batches=lambda *a: built.append(a))
  assert not built  # the batch source was never asked for


def test_packing_is_checked_before_data_preparation(tmp_path):
  config = pretrain.get_config("tiny")
  config.data.update(pipeline="grain", packing="first-fit")
  with pytest.raises(ValueError, match=re.escape("config.data.packing='first-fit': choose one of")):
    loop._Run(config, str(tmp_path))
  assert not (tmp_path / "data").exists()  # nothing was prepared
