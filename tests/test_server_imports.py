"""Serving without the training stack: the server and the engine import no data or logging pipeline.

A serving process loads a checkpoint and answers requests; the data loaders
(grain, array_record) and the training loggers (tensorboard, tensorboardX)
are training dependencies it must not pull in (start-up time, memory, and
images built for serving only). Checked in a fresh interpreter, since this
test process has imported everything already.
"""

import os
import subprocess
import sys
from pathlib import Path

TRAINING_ONLY = ("grain", "array_record", "tensorboard", "tensorboardX")
REPO = Path(__file__).resolve().parents[1]


def test_server_and_engine_import_without_the_training_stack():
  code = ("import sys\n"
          "import serving.engine, serving.server\n"
          f"print(sorted(m for m in {TRAINING_ONLY!r} if m in sys.modules))\n")
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
