"""Serve a Horizon checkpoint (or a random model) over the OpenAI and Anthropic APIs.

    python -m experiments.serve --checkpoint=/tmp/horizon_tiny/checkpoints \
        --config=configs/serve.py:tiny --host=127.0.0.1 --port=8000
    python -m experiments.serve --config=configs/serve.py:tiny      # random weights
    python -m experiments.serve --config.serving.api_key=KEY --config.serving.slots=8

Then point any OpenAI or Anthropic client at it (`base_url=http://HOST:PORT/v1`
for openai, `http://HOST:PORT` for anthropic). Routes, limits and error shapes:
serving/server.py. The engine thread starts before uvicorn and stops after it.
"""

from __future__ import annotations

from pathlib import Path

import uvicorn
from absl import app, flags, logging
from ml_collections import config_flags

from serving.engine import build_engine
from serving.server import create_app

_DEFAULT_CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "serve.py") + ":tiny"
_CONFIG = config_flags.DEFINE_config_file(
    "config", _DEFAULT_CONFIG, "Serve config and variant, e.g. configs/serve.py:small.", lock_config=True)
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Checkpoint directory of the pretraining launcher; "
                                  "unset: a randomly initialised model from the config.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Interface to bind (0.0.0.0: all).")
_PORT = flags.DEFINE_integer("port", 8000, "TCP port.")


def main(argv) -> None:
  del argv
  config = _CONFIG.value
  engine = build_engine(config, _CHECKPOINT.value).start()
  logging.info("engine: %d slots x %d tokens, model %s", engine.slots, engine.max_context,
               config.serving.model_name)
  try:
    uvicorn.run(create_app(engine, engine.tokenizer, config), host=_HOST.value, port=_PORT.value,
                log_level="info")
  finally:
    engine.stop()


if __name__ == "__main__":
  app.run(main)
