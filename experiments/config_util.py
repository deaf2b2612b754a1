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


def log_to_workdir(workdir: str, program: str) -> None:
  """Sends absl (and orbax's) INFO lines to <workdir>/logs/<program>.INFO; the console keeps
  warnings, errors and what the launcher prints itself (progress, the summary)."""
  import os

  from absl import logging
  if "://" in workdir:  # a bucket: absl writes local files only, so logs stay on the console
    return
  logs = os.path.join(workdir, "logs")
  os.makedirs(logs, exist_ok=True)
  logging.get_absl_handler().use_absl_log_file(program, logs)
  logging.set_stderrthreshold(logging.WARNING)
