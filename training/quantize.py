"""Dense checkpoint -> MXFP4 checkpoint (the library half of experiments/quantize.py).

See model/quant.py for what is quantized and how it is stored. Nothing partial
is ever left at the output: every check (input exists, config, K divisible by
32, output free) runs before anything is written, and the checkpoint is
written to a sibling temporary directory that is renamed only once complete.
"""

from __future__ import annotations

import json
import shutil
import uuid
from typing import Any

from etils import epath

from configs import horizon
from model.quant import quantize_model, quantized_bytes
from training.checkpoint import Checkpointer, CheckpointError, load_model, read_meta, stored_model_config


def _check_out(out: epath.Path) -> None:
  if out.exists() and any(out.iterdir()):
    raise CheckpointError(f"--out={out} exists and is not empty; choose a new directory "
                          "(nothing was written).")


def convert(src: str, dst: str, what: str = "experts", mode: str = "floor",
            step: int | None = None, fallback_config: Any = None) -> dict:
  """Quantizes checkpoint `src` into a new checkpoint `dst`; returns a summary dict."""
  src_path, out = epath.Path(src), epath.Path(dst)
  if not src_path.exists():
    raise CheckpointError(f"--checkpoint={src} does not exist.")
  _check_out(out)
  meta = read_meta(src_path, step)
  config = meta.get("config")
  if config:
    # Current defaults for fields newer than the checkpoint; the stored values override them.
    variant = config.get("variant") if config.get("variant") in horizon.VARIANTS else "tiny"
    fallback = horizon.get_config(variant).model
  elif fallback_config:
    config = fallback_config.to_dict()
    fallback = config["model"]
  else:
    raise CheckpointError(f"checkpoint {src} stores no config; pass --config=configs/horizon.py:"
                          "<variant> matching it.")
  cfg = stored_model_config(src_path, fallback, meta["step"])
  if cfg.quantization != "none":
    raise CheckpointError(f"checkpoint {src} is already quantized (model.quantization="
                          f"{cfg.quantization!r}); convert the dense checkpoint instead.")
  model = load_model(src_path, cfg, step=meta["step"])
  dense_bytes = quantized_bytes(model)["other"]
  paths = quantize_model(model, what, mode)  # raises (naming the weight) before any write
  sizes = quantized_bytes(model)
  config = json.loads(json.dumps(config))
  config.setdefault("model", {})
  config["model"]["quantization"] = what
  config["model"].pop("attention_impl", None)
  config["model"]["kernels"] = cfg.kernels
  config["quantize"] = {"source": str(src_path), "source_step": meta["step"], "what": what,
                        "mode": mode, "weights": len(paths)}
  tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
  try:
    with Checkpointer(tmp, every=1, keep=1, async_save=False) as ckpt:
      ckpt.save(meta["step"], model=model, config=config, force=True)
      ckpt.wait()
    if out.exists():
      out.rmdir()  # empty (checked above)
    tmp.rename(out)
  finally:
    if tmp.exists():
      shutil.rmtree(tmp, ignore_errors=True)
  return {"out": str(out), "step": meta["step"], "what": what, "mode": mode,
          "quantized_weights": len(paths), "bytes_before": dense_bytes,
          "bytes_after": sizes["mxfp4"] + sizes["other"], "mxfp4_bytes": sizes["mxfp4"]}
