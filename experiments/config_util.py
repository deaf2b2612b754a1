"""The `--config=configs/<file>.py:<variant>` flag shared by the launchers (absl glue, no logic)."""

import contextlib
import os
import sys

from absl import app, flags
from ml_collections import config_flags


def define_config_flag(required: bool = True):
  """Defines --config (a configs/*.py file and variant, `--config.x.y=...` overrides)."""
  holder = config_flags.DEFINE_config_file(
      "config", None, "Config file and variant, e.g. configs/horizon.py:tiny.", lock_config=True)
  if required:
    flags.mark_flag_as_required("config")
  return holder


def run_app(main) -> None:
  """`app.run(main)`, except that a bad --config (a typo'd override such as
  `--config.model.num_layer=3`, a wrong type, an unknown variant) ends with its one-line reason
  and ml_collections' suggestion instead of a 50-line traceback with the hint in the middle, that a
  stray positional argument is refused instead of ignored, and that a user error raised while it
  runs (USER_ERRORS: a bad config value, checkpoint, task file...) ends with its one-line
  message (exit 1; HORIZON_TRACEBACK=1 keeps the traceback)."""
  def parse(argv):
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:  # absl's own report embeds the config file's traceback as text
      sys.exit(f"FATAL flags error: {_flag_error_reason(str(e))}\n"
               "Pass --helpshort or --helpfull to see help on flags.")
    except (AttributeError, KeyError, TypeError, ValueError) as e:
      reason = str(e)
      if len(reason) > 1 and reason[0] == reason[-1] and reason[0] in "'\"":  # a KeyError's repr
        reason = reason[1:-1]
      reason = reason.replace("\\n", " ").replace("\\'", "'").replace("\n", " ")
      overrides = " ".join(a for a in argv[1:] if a.startswith("--config"))
      sys.exit(f"FATAL flags error: {reason}\n(in {overrides}; configs/*.py lists the fields)")
  def checked(argv):
    if len(argv) > 1:  # `--flag false` sets a boolean flag and leaves "false" here, unread
      raise app.UsageError(f"unexpected arguments {argv[1:]}; flags take the form --flag=value")
    with user_errors_in_one_line():
      return main(argv)
  app.run(checked, flags_parser=parse)


def _flag_error_reason(message: str) -> str:
  """An absl flag error in one line: a traceback it holds as text (a configs/*.py file that raised,
  e.g. on an unknown variant) reduced to the flag and the exception's last line."""
  lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
  if any(ln.startswith("Traceback (most recent call last)") for ln in lines):
    return f"{lines[0]} {lines[-1]}"
  return " ".join(lines)


# The errors that mean "the input is wrong" (a config field, a flag, a checkpoint, a data or task
# file, an endpoint), each raised with a message that names the field and the fix. A launcher ends
# with that message alone; any other exception keeps its traceback. Named by module so that a
# launcher imports only what it uses (an error whose module was never imported was never raised).
USER_ERRORS = (("model.config", "ConfigError"), ("training.checkpoint_meta", "CheckpointError"),
               ("training.data_sources", "DataError"), ("training.shapes_vqa", "RunArgsError"),
               ("sharding.mesh", "MeshError"), ("sharding.rules", "ShardingError"),
               ("rl.tasks.schema", "TaskError"), ("rl.sft.data", "ChatDataError"),
               ("rl.eval.compare", "CompareError"), ("rl.agent.http", "EndpointError"),
               ("training.tokenizer", "TokenizerError"))


def user_error_classes() -> tuple[type[Exception], ...]:
  """The classes of USER_ERRORS whose modules this process has imported."""
  found = (getattr(sys.modules.get(module), name, None) for module, name in USER_ERRORS)
  return tuple(cls for cls in found if cls is not None)


@contextlib.contextmanager
def user_errors_in_one_line():
  """A user error (USER_ERRORS) raised inside ends the process with its message: exit status 1,
  `FATAL <class>: <message>` on stderr. Set HORIZON_TRACEBACK=1 to get the traceback instead."""
  try:
    yield
  except user_error_classes() as e:  # the tuple is built when an exception arrives
    if os.environ.get("HORIZON_TRACEBACK"):
      raise
    sys.exit(f"FATAL {type(e).__name__}: {e}\n(HORIZON_TRACEBACK=1 shows where it was raised)")


def model_overrides(flag: str = "config", flag_values: flags.FlagValues = flags.FLAGS) -> dict:
  """The `--config.model.*` fields set on this command line ({'kernels': 'pallas', ...}): what a
  loaded checkpoint's stored model config takes from the command line
  (`model.config.with_runtime_overrides`)."""
  values = config_flags.get_override_values(flag_values[flag])
  return {k[len("model."):]: v for k, v in values.items() if k.startswith("model.")}


def apply_init_checkpoint(config, init_checkpoint: str | None, flag: str = "config",
                          flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """`--init_checkpoint=PATH` into config.checkpoint.init_from (over the config file's value). Given
  together with a different `--config.checkpoint.init_from` on the same command line, it is refused
  naming both instead of one of them winning silently."""
  if not init_checkpoint:
    return
  given = config_flags.get_override_values(flag_values[flag]).get("checkpoint.init_from")
  if given is not None and given != init_checkpoint:
    from model.config import ConfigError
    raise ConfigError(f"--init_checkpoint={init_checkpoint!r} and --config.checkpoint.init_from={given!r} "
                      "name different starting weights; give one of them.")
  with config.unlocked():
    config.checkpoint.init_from = init_checkpoint


def define_distributed_flags():
  """Defines --coordinator_address, --num_processes, --process_id, --local_device_ids and
  --distributed (one process, or many: sharding/distributed.py); returns a function that
  initialises jax.distributed from them (call it before anything touches a device)."""
  coord = flags.DEFINE_string("coordinator_address", None,
                              "host:port of process 0 (env JAX_COORDINATOR_ADDRESS).")
  nproc = flags.DEFINE_integer("num_processes", None, "Number of processes (env JAX_NUM_PROCESSES).")
  pid = flags.DEFINE_integer("process_id", None, "This process's id (env JAX_PROCESS_ID).")
  local = flags.DEFINE_string("local_device_ids", None,
                              "Comma list of local device ids (env JAX_LOCAL_DEVICE_IDS).")
  from sharding import distributed
  mode = flags.DEFINE_enum("distributed", "auto", list(distributed.MODES),
                           "Call jax.distributed.initialize: auto (when addresses are given), on, off.")

  def initialize() -> bool:
    return distributed.initialize(mode.value, coordinator_address=coord.value, num_processes=nproc.value,
                                  process_id=pid.value, local_device_ids=local.value)
  return initialize


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
