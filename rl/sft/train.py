"""`experiments.sft`: SFT through the one training loop (training/loop.py) with SFT batches."""

from __future__ import annotations

from typing import Any

from etils import epath

from model.config import model_config
from rl.agent.loop import LoopConfig
from rl.envs.base import EnvContext
from rl.sft.checks import check_sft_config
from rl.sft.source import SFTBatches
from serving.chat import ChatRenderer
from training import batches as batches_lib
from training import loop
from training.checkpoint import CheckpointNotFoundError, read_meta


def check_resumed_data(config, run_checkpoints: Any) -> None:
  """A run resuming its own checkpoint: the SFT data it trained on against config, before any
  oracle episode is played again (`SFTBatches.check_state` names each field that differs)."""
  try:
    meta = read_meta(run_checkpoints)
  except CheckpointNotFoundError:
    return  # a fresh run
  SFTBatches.check_state(config, meta["data_state"])


def run_sft(config, workdir: str) -> dict[str, Any]:
  """Trains on config.sft's data (checkpoints, resume, metrics as pretraining); returns the summary.

  config.checkpoint.init_from starts a fresh run from pretrained weights. config.sft is checked
  first, and a resumed run's data against its checkpoint's before the data is built.
  """
  check_sft_config(config)
  cfg = model_config(config)
  tokenizer = batches_lib.tokenizer_for(config)
  renderer = ChatRenderer(tokenizer, cfg.vision.num_patches if cfg.vision.enabled else 0)
  ctx = EnvContext.from_config(config.env)
  loop_config = LoopConfig.from_config(config.env)

  def make_batches(config, workdir, cfg, mesh, tc):
    del cfg
    check_resumed_data(config, epath.Path(workdir) / "checkpoints")
    return SFTBatches(config, mesh, tc, tokenizer, renderer, ctx, loop_config)

  return loop.run(config, workdir, make_batches)
