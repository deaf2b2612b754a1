"""Dense checkpoint -> MXFP4 checkpoint (the library half of experiments/quantize.py).

Which tensors become MXFP4 is `model.quant.plan`: one decision per tensor,
with the reason for each one kept dense, a pure function of the model's shapes
and `what`. The output stores `model.quantization = what`, so the loader
(`load_model` -> `abstract_model` -> `quantize_model`) rebuilds exactly the
structure that was written; the paths of the MXFP4 tensors are recorded too
(`config.quantize.mxfp4`). `table` prints the decisions.

Optionally (`eval_tokens`) the mean next-token loss on held-out text is
measured before and after: windows of the run's `train.seq_len` tokens of
`training.tokenizer.stdlib_heldout_text` (whole standard-library files after
the first 8 MiB), held out from pretraining when the run read only the
documents before them (`--config.data.max_docs=700` on the default stdlib
source, as in the README's recipe).

Nothing partial is ever left at the output: every check (input exists,
config, output free, tokenizer) runs before anything is written, and the
checkpoint is written to a sibling temporary directory that is renamed only
once complete.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import uuid
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from etils import epath
from flax import nnx

from configs import horizon
from model.quant import EXPERT_WEIGHTS, Decision, plan, quantize_model
from training.checkpoint import Checkpointer, CheckpointError, load_model, read_meta, stored_model_config
from training.tokenizer import default_tokenizer_path, load_tokenizer, stdlib_heldout_text
from training.train_step import token_cross_entropy

EVAL_BATCH = 8  # held-out windows per forward pass


@dataclasses.dataclass
class Converted:
  """What `convert` did: the JSON-able summary and the per-tensor decisions."""
  summary: dict[str, Any]
  decisions: list[Decision]


def _check_out(out: epath.Path, src: epath.Path) -> None:
  if out.exists() and not out.is_dir():
    raise CheckpointError(f"--out={out} is a file; choose a new directory (nothing was written).")
  if out.exists() and any(out.iterdir()):
    raise CheckpointError(f"--out={out} exists and is not empty; choose a new directory "
                          "(nothing was written).")
  # Inside the source, a numeric name became a "step" of the source run that every reader then
  # picked as its latest and failed on; any other name is still a stray in the run's directory.
  a, b = (str(p.resolve()) if "://" not in str(p) else str(p).rstrip("/") for p in (out, src))
  if a == b or a.startswith(b + "/") or b.startswith(a + "/"):
    raise CheckpointError(f"--out={out} is inside (or holds) --checkpoint={src}; write the quantized "
                          "checkpoint to a directory of its own (nothing was written).")


def _source_config(src_path: epath.Path, meta: dict, fallback_config: Any) -> tuple[dict, Any]:
  """(the run config to store, the checkpoint's ModelConfig)."""
  config = meta.get("config")
  if config:
    # Current defaults for fields newer than the checkpoint; the stored values override them.
    variant = config.get("variant") if config.get("variant") in horizon.VARIANTS else "tiny"
    fallback = horizon.get_config(variant).model
  elif fallback_config:
    config = fallback_config.to_dict()
    fallback = config["model"]
  else:
    raise CheckpointError(f"checkpoint {src_path} stores no config; pass --config=configs/horizon.py:"
                          "<variant> matching it.")
  cfg = stored_model_config(src_path, fallback, meta["step"])
  if cfg.quantization != "none":
    raise CheckpointError(f"checkpoint {src_path} is already quantized (model.quantization="
                          f"{cfg.quantization!r}); convert the dense checkpoint instead.")
  return json.loads(json.dumps(config)), cfg


def heldout_windows(config: dict, cfg: Any, tokens: int) -> np.ndarray:
  """int32 [n, seq_len + 1]: consecutive windows of the held-out text, n * seq_len <= tokens."""
  run_data = config.get("data") or {}
  path = run_data.get("tokenizer") or default_tokenizer_path(config.get("variant") or "tiny")
  tokenizer = load_tokenizer(path, model_vocab_size=cfg.vocab_size, image_token_id=cfg.image_token_id)
  seq_len = min(int((config.get("train") or {}).get("seq_len", 256)), cfg.max_seq_len - 1)
  ids = np.asarray(tokenizer.encode(stdlib_heldout_text()), np.int32)
  n = min(tokens, len(ids) - 1) // seq_len
  if n >= EVAL_BATCH:
    n -= n % EVAL_BATCH  # whole batches: one compiled program
  if n < 1:
    raise CheckpointError(f"--eval_tokens={tokens} is less than one window of train.seq_len={seq_len} "
                          "tokens; raise it.")
  return np.stack([ids[i * seq_len:(i + 1) * seq_len + 1] for i in range(n)])


@nnx.jit
def _ce_sum(model: nnx.Module, window: jax.Array) -> jax.Array:
  logits, _ = model(window[:, :-1])
  ce, _ = token_cross_entropy(logits, window[:, 1:], jnp.ones(window[:, 1:].shape, jnp.float32))
  return ce


def heldout_loss(model: nnx.Module, windows: np.ndarray) -> float:
  """Mean next-token cross-entropy (nats/token) of `model` over `windows` [n, t + 1]."""
  batch = min(EVAL_BATCH, len(windows))
  total = sum(float(_ce_sum(model, jnp.asarray(windows[i:i + batch])))
              for i in range(0, len(windows), batch))
  return total / (len(windows) * (windows.shape[1] - 1))


def _experts_kept_dense(decisions: list[Decision]) -> bool:
  return any(d.path.endswith("ffn/" + EXPERT_WEIGHTS[0]) and len(d.shape) == 3 and not d.mxfp4
             for d in decisions)


def _stored_config(config: dict, cfg: Any, what: str, mode: str, src: str, step: int,
                   decisions: list[Decision]) -> dict:
  config.setdefault("model", {})
  config["model"]["quantization"] = what
  config["model"].pop("attention_impl", None)
  # The MoE's Pallas path reads MXFP4 experts only: routed experts kept dense run the XLA path.
  config["model"]["kernels"] = "xla" if _experts_kept_dense(decisions) else cfg.kernels
  paths = [d.path for d in decisions if d.mxfp4]
  config["quantize"] = {"source": src, "source_step": step, "what": what, "mode": mode,
                        "weights": len(paths), "mxfp4": paths}
  return config


def _write(out: epath.Path, step: int, model: nnx.Module, config: dict) -> None:
  tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
  try:
    with Checkpointer(tmp, every=1, keep=1, async_save=False) as ckpt:
      ckpt.save(step, model=model, config=config, force=True)
      ckpt.wait()
    if out.exists():
      out.rmdir()  # empty (checked above)
    tmp.rename(out)
  finally:
    if tmp.exists():
      shutil.rmtree(tmp, ignore_errors=True)


def totals(decisions: list[Decision]) -> dict[str, Any]:
  """Counts, weights and bytes over all decisions (the table's last lines)."""
  q = [d for d in decisions if d.mxfp4]
  elements = sum(d.elements for d in decisions)
  before = sum(d.bytes_before for d in decisions)
  after = sum(d.bytes_after for d in decisions)
  return {"tensors": len(decisions), "mxfp4_tensors": len(q), "dense_tensors": len(decisions) - len(q),
          "weights": elements, "mxfp4_weights": sum(d.elements for d in q),
          "bytes_before": before, "bytes_after": after, "mxfp4_bytes": sum(d.bytes_after for d in q),
          "bits_per_weight_before": 8 * before / max(elements, 1),
          "bits_per_weight_after": 8 * after / max(elements, 1)}


def convert(src: str, dst: str, what: str = "experts", mode: str = "floor",
            step: int | None = None, fallback_config: Any = None, eval_tokens: int = 0) -> Converted:
  """Quantizes checkpoint `src` into a new checkpoint `dst` (see the module docstring)."""
  src_path, out = epath.Path(src), epath.Path(dst)
  if not src_path.exists():
    raise CheckpointError(f"--checkpoint={src} does not exist.")
  if eval_tokens < 0:
    raise CheckpointError(f"--eval_tokens={eval_tokens} must be >= 0 (0: no held-out loss).")
  _check_out(out, src_path)
  meta = read_meta(src_path, step)
  config, cfg = _source_config(src_path, meta, fallback_config)
  windows = heldout_windows(config, cfg, eval_tokens) if eval_tokens else None
  model = load_model(src_path, cfg, step=meta["step"])
  decisions = plan(model, what)
  summary: dict[str, Any] = {"out": str(out), "step": meta["step"], "what": what, "mode": mode}
  if windows is not None:
    logging.info("held-out loss of the dense model on %d windows", len(windows))
    summary["heldout"] = {"tokens": int(windows[:, 1:].size), "loss_before": heldout_loss(model, windows)}
  paths = quantize_model(model, what, mode)
  if not paths:
    logging.warning("no tensor of %s has an axis of a multiple of 32 that --what=%s selects; the "
                    "output holds the dense weights (see the table)", src, what)
  if windows is not None:
    h = summary["heldout"]
    h["loss_after"] = heldout_loss(model, windows)
    h["delta"] = h["loss_after"] - h["loss_before"]
  config = _stored_config(config, cfg, what, mode, str(src_path), meta["step"], decisions)
  _write(out, meta["step"], model, config)
  t = totals(decisions)
  summary.update(kernels=config["model"]["kernels"], quantized_weights=len(paths), **t)
  return Converted(summary, decisions)


# ---- the printed table ----------------------------------------------------------------

_LAYER = re.compile(r"^blocks/(\d+)/")


def _layers(ids: list[int]) -> str:
  """Compact layer set: '0,2', '3-92', '0,4,..,92'."""
  steps = {b - a for a, b in zip(ids, ids[1:], strict=False)}
  if len(ids) <= 3 or len(steps) > 1:
    return ",".join(map(str, ids))
  return f"{ids[0]}-{ids[-1]}" if steps == {1} else f"{ids[0]},{ids[1]},..,{ids[-1]}"


def _group(d: Decision) -> tuple[str, str]:
  """(row key, shape column): one row per weight over the layers, the vision encoder and the 1-D
  vectors one row each."""
  if d.path.startswith("vision/"):
    return "vision/**", "various"
  if len(d.shape) < 2 and d.reason.startswith("vector"):
    return "1-D vectors: norms, biases, A_log, dt_bias", "various"
  return _LAYER.sub("blocks/*/", d.path), "x".join(map(str, d.shape))


def _row_name(key: str, ds: list[Decision]) -> str:
  ids = [int(m.group(1)) for m in (_LAYER.match(d.path) for d in ds) if m]
  if not ids or "blocks/*/" not in key:
    return key
  return key.replace("*", str(ids[0]) if len(ids) == 1 else "{" + _layers(ids) + "}", 1)


def _size(n: float) -> str:
  for unit, div in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
    if n >= div:
      return f"{n / div:.2f} {unit}"
  return f"{int(n)} B"


def table(decisions: list[Decision]) -> str:
  """One row per tensor group: name, count, shape, stored as, bits/weight, bytes, note; then totals."""
  rows: dict[tuple, list[Decision]] = {}
  for d in decisions:
    rows.setdefault((*_group(d), d.mxfp4, d.dtype, d.reason), []).append(d)
  names = {k: _row_name(k[0], ds) for k, ds in rows.items()}
  name_w = max(map(len, names.values())) + 2
  lines = [f"{'tensor':<{name_w}}{'n':>4}  {'shape':<12}{'stored':<8}{'bits/w':>7}{'before':>12}"
           f"{'after':>12}  reason kept dense / note"]
  for key, ds in rows.items():
    _, shape, q, dtype, reason = key
    bits = ds[0].bits_per_weight
    lines.append(f"{names[key]:<{name_w}}{len(ds):>4}  {shape:<12}{'mxfp4' if q else dtype:<8}{bits:>7.2f}"
                 f"{_size(sum(d.bytes_before for d in ds)):>12}{_size(sum(d.bytes_after for d in ds)):>12}"
                 f"  {reason}")
  t = totals(decisions)
  lines.append(f"total: {t['tensors']} tensors, {t['mxfp4_tensors']} MXFP4 + {t['dense_tensors']} dense; "
               f"{t['weights']:,} weights, {t['mxfp4_weights'] / max(t['weights'], 1):.1%} in MXFP4; "
               f"{_size(t['bytes_before'])} -> {_size(t['bytes_after'])} "
               f"({t['bits_per_weight_before']:.2f} -> {t['bits_per_weight_after']:.2f} bits/weight)")
  return "\n".join(lines)
