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


def test_init_from_is_read_before_data_and_named_on_resume(tmp_path, caplog):
  from flax import nnx

  from model.config import ModelConfig
  from model.decoder import Horizon
  from training.checkpoint import Checkpointer, CheckpointNotFoundError

  config = pretrain.get_config("tiny")
  config.checkpoint.init_from = str(tmp_path / "nope")
  built = []
  with pytest.raises(CheckpointNotFoundError, match="nope"):
    loop._Run(config, str(tmp_path / "fresh"), make_batches=lambda *a: built.append(a))
  assert not built  # a fresh run's wrong init_from fails before the data is built

  # A resumed run keeps its own weights: another init_from is ignored, and said so.
  run_dir = tmp_path / "run"
  started = pretrain.get_config("tiny")
  started.checkpoint.init_from = "/somewhere/else"
  model = Horizon(ModelConfig.from_config(started.model), rngs=nnx.Rngs(0))
  ck = Checkpointer(str(run_dir / "checkpoints"), every=1, keep=1, async_save=False)
  ck.save(1, model=model, config=started.to_dict(), force=True)
  ck.wait()
  with caplog.at_level("WARNING"):
    loop.check_init_from(config, run_dir / "checkpoints")
  assert "is ignored: this run resumes from" in caplog.text and "/somewhere/else" in caplog.text
  from training.checkpoint import read_meta
  for wrong in (run_dir, run_dir / "checkpoints" / "1"):  # the run's directory, or one step's
    with pytest.raises(CheckpointNotFoundError, match=re.escape("; pass <workdir>/checkpoints.")):
      read_meta(wrong)


def _checkpointed_run(run_dir, config, step):
  from flax import nnx

  from model.config import ModelConfig
  from model.decoder import Horizon
  from training.checkpoint import Checkpointer

  model = Horizon(ModelConfig.from_config(config.model), rngs=nnx.Rngs(0))
  ck = Checkpointer(str(run_dir / "checkpoints"), every=1, keep=1, async_save=False)
  ck.save(step, model=model, config=config.to_dict(), force=True)
  ck.wait()


def test_a_resume_is_checked_against_its_checkpoint_before_anything_is_built(tmp_path):
  """train.steps below the saved step re-saved the last weights under a smaller step; a changed
  config.model trained on silently or failed a minute later naming a tensor."""
  run_dir = tmp_path / "run"
  _checkpointed_run(run_dir, pretrain.get_config("tiny"), step=4)
  built = []
  fewer = pretrain.get_config("tiny")
  fewer.train.steps = 3
  below = "config.train.steps=3 is below step 4 of this run's checkpoint"
  with pytest.raises(ValueError, match=re.escape(below)):
    loop._Run(fewer, str(run_dir), make_batches=lambda *a: built.append(a))
  other = pretrain.get_config("tiny")
  other.model.update(expert_dim=30, router_score="softmax", remat="full")  # remat may change on resume
  differs = (r"config.model differs from the checkpoint this run resumes .*step 4\): "
             r"expert_dim \(checkpoint 26, now 30\); router_score \(checkpoint 'sigmoid', now 'softmax'\)\.")
  with pytest.raises(ValueError, match=differs):
    loop._Run(other, str(run_dir), make_batches=lambda *a: built.append(a))
  assert not built
  same = pretrain.get_config("tiny")
  same.model.remat = "full"
  loop.check_resume(same, loop.model_config(same), run_dir / "checkpoints")  # runtime-only changes resume


def test_layout_and_quantization_are_checked_before_data(tmp_path):
  built = []

  def refused(match, **changes):
    config = pretrain.get_config("tiny")
    for path, value in changes.items():
      section, field = path.split("__")
      config[section][field] = value
    with pytest.raises(Exception, match=match):
      loop._Run(config, str(tmp_path / "w"), make_batches=lambda *a: built.append(a))

  # 8 test devices on fsdp: a batch of 12 was replicated, every device computing all of it.
  refused(re.escape("config.train.global_batch=12 is not divisible by grad_accum=1 x the batch mesh axes"),
          train__global_batch=12)
  refused(re.escape("config.train.seq_len=1024 exceeds config.model.max_seq_len=256"), train__seq_len=1024)
  refused("training keeps dense weights", model__quantization="experts")  # saved as MXFP4, loaded by nothing
  config = pretrain.get_config("tiny")
  config.data.update(pipeline="bytes", shuffle_seed=-1)
  with pytest.raises(ValueError, match=re.escape("config.data.shuffle_seed=-1: the bytes pipeline needs")):
    loop._Run(config, str(tmp_path / "w"))  # failed inside numpy once the model was built
  refused(r"heads.*tensor", mesh__tensor=2, mesh__fsdp=-1)  # a weight dim the mesh does not divide
  assert not built
