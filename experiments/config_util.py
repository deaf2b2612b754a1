"""The `--config=configs/<file>.py:<variant>` flag shared by the launchers (absl glue, no logic)."""

from absl import flags
from ml_collections import config_flags


def define_config_flag(required: bool = True):
  """Defines --config (a configs/*.py file and variant, `--config.x.y=...` overrides)."""
  holder = config_flags.DEFINE_config_file(
      "config", None, "Config file and variant, e.g. configs/horizon.py:tiny.", lock_config=True)
  if required:
    flags.mark_flag_as_required("config")
  return holder
