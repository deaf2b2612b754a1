"""Serve a Horizon checkpoint (or a random model) over the OpenAI and Anthropic APIs.

    python -m experiments.serve --checkpoint=/tmp/horizon_tiny/checkpoints \
        --config=configs/serve.py:tiny --host=127.0.0.1 --port=8000
    python -m experiments.serve --config=configs/serve.py:tiny      # random weights
    python -m experiments.serve --config.serving.api_key=KEY --config.serving.slots=8

Then point any OpenAI or Anthropic client at it (`base_url=http://HOST:PORT/v1`
for openai, `http://HOST:PORT` for anthropic). Routes, limits and error shapes:
serving/server.py. The engine thread starts before uvicorn and stops after it;
`/health` answers 200 once the warm-up has compiled the engine's programs
(serving/warmup.py). INFO logs (checkpoint loading, absl) go to
<workdir>/logs/serve.INFO, with uvicorn's access log; the console shows the
warm-up's progress, uvicorn's start-up lines and warnings.
"""

from __future__ import annotations

import logging as pylogging
import sys
from pathlib import Path

import uvicorn
from absl import flags
from ml_collections import config_flags

from experiments.config_util import log_to_workdir, model_overrides, run_app
from serving.build import build_engine
from serving.server import create_app

_DEFAULT_CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "serve.py") + ":tiny"
_CONFIG = config_flags.DEFINE_config_file(
    "config", _DEFAULT_CONFIG, "Serve config and variant, e.g. configs/serve.py:small.", lock_config=True)
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Checkpoint directory of the pretraining launcher; "
                                  "unset: a randomly initialised model from the config.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Interface to bind (0.0.0.0: all).")
# Bounded: absl refuses --port=70000 with a usage error at parse time, before the model loads
# (unbounded, the socket layer silently binds 70000 mod 65536).
_PORT = flags.DEFINE_integer("port", 8000, "TCP port (0-65535).", lower_bound=0, upper_bound=65535)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/horizon_serve", "INFO logs go to <workdir>/logs.")


def _to_console(logger: str) -> None:
  """Also prints `logger`'s INFO lines (the warm-up's progress) on the console."""
  handler = pylogging.StreamHandler(sys.stdout)
  handler.setFormatter(pylogging.Formatter("%(message)s"))
  pylogging.getLogger(logger).addHandler(handler)
  pylogging.getLogger(logger).setLevel(pylogging.INFO)


def main(argv) -> None:
  del argv
  config = _CONFIG.value
  log_to_workdir(_WORKDIR.value, "serve")
  _to_console("serving.warmup")
  print(f"loading {_CHECKPOINT.value or 'a random model'} ({config.serving.model_name}) ...", flush=True)
  engine = build_engine(config, _CHECKPOINT.value, model_overrides=model_overrides()).start()
  print(f"engine: {engine.slots} slots x {engine.max_context} tokens, model {config.serving.model_name}; "
        f"logs in {_WORKDIR.value}/logs", flush=True)
  _to_console("uvicorn.error")  # "Uvicorn running on ..."; the access log goes to the file
  try:
    # log_config=None: uvicorn's own dictConfig would close the log file's handler.
    uvicorn.run(create_app(engine, engine.tokenizer, config), host=_HOST.value, port=_PORT.value,
                log_level="info", log_config=None)
  finally:
    engine.stop()


if __name__ == "__main__":
  run_app(main)
