"""serving/build.py's build_engine at the points a mutation audit found untested: every
config.serving field reaches the Engine under its own name, the checkpoint's one step is used for
its config and its weights, and the tokenizer comes from config.serving, else the checkpoint run's
data.tokenizer, else the bundled one of the run's variant. The Engine, the checkpoint reads, the
tokenizer loader and the model's initialisation are replaced by recorders (nothing is compiled); the
references are written out."""

import types

import pytest

from serving import build

SIZES = dict(slots=3, max_context=64, prefill_chunk=16, seed=11, max_queue=5, prefix_cache_mb=2,
             prefix_cache_block=8, prefix_cache_exact=True, decode_steps=4, batch_invariant=False)


@pytest.fixture
def recorded(monkeypatch):
  """build_engine with a recording Engine and tokenizer loader: returns what each was given."""
  seen = {}

  def engine(model, tokenizer, **kw):
    seen.update(engine=kw, model=model)
    return "engine"

  def load_tokenizer(path, **kw):
    seen.update(tokenizer=path, tokenizer_kw=kw)
    return "tokenizer"

  def build_model(cfg, seed):
    seen.update(random=(cfg.d_model, seed))
    return types.SimpleNamespace(cfg=cfg)

  monkeypatch.setattr(build, "Engine", engine)
  monkeypatch.setattr("model.decoder.build_model", build_model)
  monkeypatch.setattr("training.tokenizer.load_tokenizer", load_tokenizer)
  return seen


def _config(**serving):
  from configs import serve
  config = serve.get_config("tiny")
  config.serving.update({**SIZES, **serving})
  return config


def test_every_serving_field_reaches_the_engine(recorded):
  """A field dropped or swapped built another engine than the flags asked for (each value here is
  distinct, so a swap shows, and a dropped one is missing from what the Engine got)."""
  config = _config()
  assert build.build_engine(config) == "engine"
  assert recorded["engine"] == SIZES
  assert recorded["random"] == (config.model.d_model, 0)  # config.model, initialised with seed 0


def test_a_random_model_uses_the_variants_bundled_tokenizer_or_the_flag(recorded, tmp_path):
  from training.tokenizer import ASSETS_DIR
  config = _config()
  build.build_engine(config)
  assert recorded["tokenizer"] == str(ASSETS_DIR / "tokenizer_tiny.json")
  # checked against the model: ids past its vocabulary, the image placeholder's id
  assert (recorded["tokenizer_kw"]["model_vocab_size"], recorded["tokenizer_kw"]["image_token_id"]) == (
    config.model.vocab_size, config.model.image_token_id)
  assert recorded["tokenizer_kw"]["field"] == (
    "--config.serving.tokenizer (this one is the checkpoint run's config.data.tokenizer)")
  build.build_engine(_config(tokenizer=str(tmp_path / "t.json")))
  assert recorded["tokenizer"] == str(tmp_path / "t.json")
  assert recorded["tokenizer_kw"]["field"] == "--config.serving.tokenizer"


def _fake_checkpoint(monkeypatch, run_config):
  """training.checkpoint's readers for a checkpoint whose latest step is 7: records the steps asked."""
  from training import checkpoint
  calls = []
  cfg = build_cfg()
  monkeypatch.setattr(checkpoint, "read_meta", lambda d, step=None: calls.append(("meta", step)) or
                      {"step": 7, "config": run_config})
  monkeypatch.setattr(checkpoint, "stored_model_config",
                      lambda d, fallback, step=None: calls.append(("config", step)) or cfg)
  monkeypatch.setattr(checkpoint, "load_model",
                      lambda d, c, step=None: calls.append(("weights", step)) or types.SimpleNamespace(cfg=c))
  return calls


def build_cfg():
  from configs import horizon
  from model.config import ModelConfig
  return ModelConfig.from_config(horizon.get_config("tiny").model)


def test_a_checkpoint_is_read_at_one_step_for_its_config_and_weights(recorded, monkeypatch):
  """The config and the weights must come from the step read_meta resolved (latest: 7), not from
  the step argument (None) each resolving the latest on its own."""
  calls = _fake_checkpoint(monkeypatch, {"variant": "tiny"})
  build.build_engine(_config(), "/ckpt")
  assert calls == [("meta", None), ("config", 7), ("weights", 7)]
  calls.clear()
  build.build_engine(_config(), "/ckpt", step=5)
  assert calls[0] == ("meta", 5) and calls[1:] == [("config", 7), ("weights", 7)]


def test_a_checkpoints_tokenizer_comes_from_its_run(recorded, monkeypatch, tmp_path):
  from training.tokenizer import ASSETS_DIR
  _fake_checkpoint(monkeypatch, {"data": {"tokenizer": "/run/tok.json"}, "variant": "small"})
  build.build_engine(_config(), "/ckpt")
  assert recorded["tokenizer"] == "/run/tok.json"
  _fake_checkpoint(monkeypatch, {"data": {"tokenizer": ""}, "variant": "agent"})
  build.build_engine(_config(), "/ckpt")  # the run's variant, not the serve config's (tiny)
  assert recorded["tokenizer"] == str(ASSETS_DIR / "tokenizer_agent.json")
  _fake_checkpoint(monkeypatch, {"data": {"tokenizer": "/run/tok.json"}, "variant": "small"})
  build.build_engine(_config(tokenizer=str(tmp_path / "t.json")), "/ckpt")  # the flag wins
  assert recorded["tokenizer"] == str(tmp_path / "t.json")


def test_a_bad_serve_config_stops_before_the_model_is_built(recorded):
  """Without the check, a bad size failed only once the weights were built or loaded (minutes)."""
  from model.config import ConfigError
  with pytest.raises(ConfigError, match="slots=0 must be a positive int"):
    build.build_engine(_config(slots=0))
  assert "random" not in recorded and "engine" not in recorded
