"""Config loading shared by the launchers: `--config=configs/<file>.py:<variant>`."""

from ml_collections import config_flags

from model.config import ModelConfig


def define_config_flag():
  return config_flags.DEFINE_config_file(
      "config", None, "Config file and variant, e.g. configs/horizon.py:tiny.", lock_config=True)


def model_config(config) -> ModelConfig:
  if config is None:
    raise SystemExit("--config is required, e.g. --config=configs/horizon.py:tiny")
  return ModelConfig.from_config(config.model)
