"""`experiments.sft`: SFT through the one training loop (training/loop.py) with SFT batches."""

from __future__ import annotations

from typing import Any

from model.config import model_config
from rl.agent.loop import LoopConfig
from rl.envs.base import EnvContext
from rl.sft.source import SFTBatches
from serving.chat import ChatRenderer
from training import batches as batches_lib
from training import loop


def run_sft(config, workdir: str) -> dict[str, Any]:
  """Trains on config.sft's data (checkpoints, resume, metrics as pretraining); returns the summary.

  config.checkpoint.init_from starts a fresh run from pretrained weights.
  """
  cfg = model_config(config)
  tokenizer = batches_lib.tokenizer_for(config)
  renderer = ChatRenderer(tokenizer, cfg.vision.num_patches if cfg.vision.enabled else 0)
  ctx = EnvContext.from_config(config.env)
  loop_config = LoopConfig.from_config(config.env)

  def make_batches(config, workdir, cfg, mesh, tc):
    del workdir, cfg
    return SFTBatches(config, mesh, tc, tokenizer, renderer, ctx, loop_config)

  return loop.run(config, workdir, make_batches)
