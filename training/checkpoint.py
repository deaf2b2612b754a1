"""Checkpoints with orbax: asynchronous saves, a keep policy, exact resume.

Why orbax (google/orbax, `orbax.checkpoint.CheckpointManager`): it writes
every array shard from the process that holds it, through TensorStore, so a
2.8T-parameter model is saved without gathering it anywhere; it writes into a
temporary directory and *commits* the step only when every item and every
process is done (an atomic rename on POSIX, a `commit_success.txt` file on
object stores), so a save killed half-way is never mistaken for a checkpoint;
and it restores each array straight into a target sharding, so a checkpoint
written on one mesh loads onto any other mesh or device count.

Layout of one step (`<directory>/<step>/`), three orbax items:
  params     the model's nnx state as a pure dict: every Variable, including
             the MoE `RouterBias` (not a gradient-trained parameter, but part
             of the model's function).
  opt_state  the optimizer's nnx state (step count + optax state); an
             `nnx.Optimizer` in flax 0.12 holds no model reference, and one
             held by `nnx.ModelAndOptimizer` ('model') is dropped: it is
             already in `params`.
  meta       JSON: format version, step, the RNG key's data, the data
             iterator state of every process (grain's `get_state()`, opaque
             JSON; each process reads its own slice of the data, so each has
             its own state), and the run's config as a dict.

Readers that need no optimizer (the server, the quantizer) use `restore_params` / `load_model`,
which restore only `params`, straight into the shardings of an abstract model (no random init).

Directories may be local paths or URLs TensorStore understands (gs://, s3://):
all file operations go through `etils.epath` and orbax; nothing here calls
`open` or `os.path`. On URLs other than gs:// orbax would default to an
atomic rename, which object stores do not have; we select the commit-file
protocol for every URL scheme, in writers and readers alike.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from model.decoder import abstract_model
from sharding import rules as rules_lib
from training.checkpoint_meta import (  # noqa: F401 - the errors, FORMAT_VERSION and rng_* are this module's API
  FORMAT_VERSION,
  CheckpointError,
  CheckpointNotFoundError,
  make_meta,
  read_meta_dict,
  rng_from_json,
  rng_to_json,
)

ITEMS = ("params", "opt_state", "meta")

_log = logging.getLogger(__name__)


# ---- orbax plumbing -----------------------------------------------------------


def _path(directory: Any) -> epath.Path:
  if not isinstance(directory, epath.PathLikeCls) or not str(directory):
    raise CheckpointError(f"checkpoint directory={directory!r}: give a local path or a URL "
                          "(gs://bucket/run, s3://bucket/run).")
  return epath.Path(directory)


def _atomicity(directory: epath.Path) -> ocp.options.AtomicityOptions | None:
  """Commit-file atomicity on any URL (object stores cannot rename atomically)."""
  if "://" in str(directory):
    return ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)
  return None


def _registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  for item in ("params", "opt_state"):
    registry.add(item, ocp.args.StandardSave, ocp.StandardCheckpointHandler)
    registry.add(item, ocp.args.StandardRestore, ocp.StandardCheckpointHandler)
  registry.add("meta", ocp.args.JsonSave, ocp.JsonCheckpointHandler)
  registry.add("meta", ocp.args.JsonRestore, ocp.JsonCheckpointHandler)
  return registry


def _reader(directory: epath.Path) -> ocp.CheckpointManager:
  """A read-only manager: never creates, cleans up or deletes anything."""
  if not directory.exists():
    raise CheckpointNotFoundError(f"no checkpoint in {directory}: the directory does not exist.")
  if not directory.is_dir():
    raise CheckpointError(f"checkpoint directory {directory} is a file; pass the directory the run "
                          "saved into (<workdir>/checkpoints).")
  options = ocp.CheckpointManagerOptions(read_only=True, create=False,
                                         atomicity_options=_atomicity(directory))
  return ocp.CheckpointManager(directory, options=options, handler_registry=_registry())


def _resolve_step(mngr: ocp.CheckpointManager, step: int | None) -> int:
  steps = sorted(mngr.all_steps())
  if not steps:
    where = epath.Path(mngr.directory)  # a run directory, or one step's, passed by mistake:
    hint = "; pass <workdir>/checkpoints" if (where / "checkpoints").exists() or where.name.isdigit() else ""
    raise CheckpointNotFoundError(f"no checkpoint in {where}: it holds no finalized step (an interrupted "
                                  f"save leaves only a temporary directory, which is ignored){hint}.")
  if step is None:
    return steps[-1]
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)):  # True read step 1
    raise CheckpointError(f"step={step!r} must be an int (finalized steps: {steps}).")
  if step not in steps:
    raise CheckpointNotFoundError(f"no checkpoint for step {step} in {mngr.directory}; "
                                  f"finalized steps: {steps}.")
  return int(step)


# ---- trees ------------------------------------------------------------------------


def model_tree(model: nnx.Module) -> dict:
  """Every Variable of `model` as a pure nested dict of arrays (the 'params' item)."""
  return nnx.to_pure_dict(nnx.state(model))


def optimizer_tree(optimizer: nnx.Module) -> dict:
  """The optimizer's state as a pure dict, without any model it references."""
  tree = nnx.to_pure_dict(nnx.state(optimizer))
  tree.pop("model", None)  # nnx.ModelAndOptimizer: the model is the 'params' item
  return tree


def _apply(module: nnx.Module, tree: dict, skip: tuple[str, ...] = ()) -> None:
  """Writes a (restored) pure dict back into `module`'s Variables, in place.

  Walks the model's Variables (not the dict's leaves), so a Variable whose
  value is itself a dict (model.quant.MXFP4Weight: blocks + scales) is set
  whole. The tree's structure was checked against the model on restore.
  Top-level entries named in `skip` are left alone (a ModelAndOptimizer's 'model').
  """
  flat = []
  for path, var in nnx.to_flat_state(nnx.state(module)):
    if path and path[0] in skip:
      continue
    node = tree
    for key in path:
      node = node[key] if key in node else node[str(key)]
    flat.append((path, var.replace(dict(node) if isinstance(node, Mapping) else node)))
  nnx.update(module, nnx.from_flat_state(flat))


def _flat(tree: Any) -> dict[str, Any]:
  """{'blocks/1/ffn/w_gate': leaf} for a nested dict (int keys as their str)."""
  out = {}

  def walk(node, prefix):
    if isinstance(node, Mapping):
      for k, v in node.items():
        walk(v, f"{prefix}/{k}" if prefix else str(k))
    else:
      out[prefix] = node

  walk(tree, "")
  return out


def _target(leaf: Any) -> jax.ShapeDtypeStruct:
  """The restore target of one leaf: its shape, dtype and sharding (default device if none)."""
  sharding = getattr(leaf, "sharding", None)
  if sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


def _check_tree(stored: Any, wanted: dict, item: str, where: str) -> None:
  """Raises CheckpointError naming the first path whose presence or shape differs."""
  have = {k: tuple(v.shape) for k, v in _flat(stored).items()}
  want = {k: tuple(v.shape) for k, v in _flat(wanted).items()}
  hint = "the checkpoint was written for a different config"
  missing = sorted(set(want) - set(have))
  extra = sorted(set(have) - set(want))
  if missing or extra:
    raise CheckpointError(f"{where}: item {item!r} does not match the model ({hint}): in the "
                          f"model but not the checkpoint: {missing[:5]}; in the checkpoint but not "
                          f"the model: {extra[:5]}.")
  for key in sorted(want):
    if have[key] != want[key]:
      raise CheckpointError(f"{where}: {item} {key} has shape {have[key]} in the checkpoint but "
                            f"{want[key]} in the model; {hint}.")


# What a damaged file raises from orbax / TensorStore / json (CheckpointError, a ValueError, is ours).
_READ_ERRORS = (ValueError, OSError, KeyError, TypeError, AttributeError)


def _damaged(mngr: ocp.CheckpointManager, step: int, what: str, e: Exception) -> CheckpointError:
  """The error for a step whose files cannot be read: the file's complaint, and the way back."""
  if isinstance(e, CheckpointError):
    return e
  steps = sorted(mngr.all_steps())
  older = [s for s in steps if s < step]
  reason = " ".join(str(e).split())
  reason = reason if len(reason) <= 400 else reason[:400] + " ..."  # TensorStore appends its 2 KB spec
  way = (f"move {mngr.directory}/{step} aside to use step {older[-1]} (finalized steps: {steps})" if older
         else "no earlier step is left to fall back on")
  return CheckpointError(f"checkpoint {mngr.directory} step {step} is damaged: reading {what} failed "
                         f"({type(e).__name__}: {reason}); {way}.")


def _restore_items(mngr: ocp.CheckpointManager, step: int, wanted: dict[str, dict]) -> dict:
  """Restores `wanted` items (name -> target tree) plus 'meta', after checking them.

  Only the wanted items are opened: `mngr.item_metadata` opened every array of every item, so a
  damaged optimizer state stopped the server, which never reads it.
  """
  where = f"checkpoint {mngr.directory} step {step}"
  step_dir = epath.Path(mngr.directory) / str(step)
  try:
    present = sorted(p.name for p in step_dir.iterdir() if p.is_dir())
  except _READ_ERRORS as e:
    raise _damaged(mngr, step, "its directory", e) from None
  for item in (*wanted, "meta"):
    if item not in present:
      hint = (" (it was saved without an optimizer: pass optimizer=None to restore only the model)"
              if item == "opt_state" else "")
      if not present:
        raise _damaged(mngr, step, "its items", FileNotFoundError(f"{step_dir} is empty (a copy that did "
                                                                  "not finish?)"))
      raise CheckpointError(f"{where}: item {item!r} is missing; it holds {present}{hint}.")
  targets = {}
  for item, tree in wanted.items():
    handler = ocp.StandardCheckpointHandler()
    try:
      stored = handler.metadata(step_dir / item).tree
    except _READ_ERRORS as e:
      raise _damaged(mngr, step, f"item {item!r}'s metadata", e) from None
    finally:
      handler.close()
    _check_tree(stored, tree, item, where)
    targets[item] = ocp.args.StandardRestore(jax.tree.map(_target, tree))
  try:
    restored = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(), **targets))
  except _READ_ERRORS as e:
    raise _damaged(mngr, step, f"items {sorted(targets) + ['meta']}", e) from None
  return {k: restored[k] for k in (*wanted, "meta")}


# ---- the writer -------------------------------------------------------------------


class Checkpointer:
  """Saves every `every` steps (asynchronously), keeps the last `keep`, resumes the latest.

  Usage (the training loop; all processes call every method):

      with Checkpointer(workdir + "/checkpoints", every=1000, keep=3) as ckpt:
        if ckpt.latest_step() is not None:
          meta = ckpt.restore(model=model, optimizer=optimizer)
          step, rng, data_state = meta["step"], meta["rng"], meta["data_state"]
        ...
        ckpt.save(step, model=model, optimizer=optimizer, data_state=it.get_state(),
                  rng=rng, config=config)

  `save` returns as soon as the arrays are copied off the accelerator; the
  write and the commit run in the background, so the next train step may
  donate the model's buffers. Only committed steps are ever listed or
  restored. On start, temporary directories left by a killed save are
  deleted (this object assumes it is the only writer of `directory`).
  """

  def __init__(self, directory: Any, *, every: int, keep: int, async_save: bool = True):
    for name, v in (("every", every), ("keep", keep)):
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
        raise CheckpointError(f"Checkpointer: {name}={v!r} must be a positive int "
                              f"(config.checkpoint.{name}).")
    self.directory = _path(directory)
    if self.directory.exists() and not self.directory.is_dir():
      raise CheckpointError(f"checkpoint directory {self.directory} is a file; move it aside or use "
                            "another --workdir (checkpoints go to <workdir>/checkpoints).")
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(int(every)),
        preservation_policy=ocp.checkpoint_managers.LatestN(int(keep)),
        enable_async_checkpointing=bool(async_save), create=True, cleanup_tmp_directories=True,
        atomicity_options=_atomicity(self.directory))
    self._mngr = ocp.CheckpointManager(self.directory, options=options,
                                       handler_registry=_registry())
    # A directory this process cannot write failed at the first save, `every` steps of work later.
    probe = self.directory / f".write_probe.{jax.process_index()}"
    try:
      probe.write_text("")
      probe.unlink()
    except OSError as e:
      self._mngr.close()
      raise CheckpointError(f"checkpoint directory {self.directory} is not writable ({e.strerror or e}); "
                            "fix its permissions or use another --workdir.") from None

  def should_save(self, step: int) -> bool:
    """Whether `save(step)` (without force) would write: step % every == 0 and step is new."""
    return self._mngr.should_save(int(step))

  def save(self, step: int, *, model: nnx.Module, optimizer: nnx.Module | None = None,
           data_state: Any = None, rng: jax.Array | None = None, config: Any = None,
           force: bool = False) -> bool:
    """Starts saving `step` if the interval (or `force`) says so; returns whether it did.

    Args:
      step: the number of optimizer steps done (the step to resume at).
      model: saved whole (every Variable).
      optimizer: an nnx.Optimizer (optional: without it the checkpoint serves readers only).
      data_state: this process's data iterator state (JSON-able, e.g. grain's get_state()).
      rng: a jax.random.key or uint32 PRNGKey, replicated.
      config: the run's config (ConfigDict, dataclass or dict), stored as JSON.
      force: save even off the interval. A step already committed is never rewritten.
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
      raise CheckpointError(f"save: step={step!r} must be a non-negative int.")
    step = int(step)
    if step in self._mngr.all_steps() or not (force or self.should_save(step)):
      return False
    items = {"params": ocp.args.StandardSave(model_tree(model)),
             "meta": ocp.args.JsonSave(make_meta(step, data_state, rng, config))}
    if optimizer is not None:
      items["opt_state"] = ocp.args.StandardSave(optimizer_tree(optimizer))
    return bool(self._mngr.save(step, args=ocp.args.Composite(**items), force=True))

  def all_steps(self) -> list[int]:
    """Committed steps, ascending."""
    return sorted(self._mngr.all_steps())

  def latest_step(self) -> int | None:
    """The newest committed step (None if there is none); in-progress saves do not count."""
    return self._mngr.latest_step()

  def restore(self, step: int | None = None, *, model: nnx.Module,
              optimizer: nnx.Module | None = None) -> dict:
    """Restores `step` (default: the latest) into `model` / `optimizer`, in place.

    Each array is read straight into the sharding the model's (optimizer's)
    current array has, so the checkpoint may come from another mesh or
    device count.

    Returns:
      {'step', 'rng', 'data_state' (this process's), 'config', 'format_version', 'process_count'}.

    Raises:
      CheckpointNotFoundError: no committed checkpoint (or not that step).
      CheckpointError: shapes differ from the model's (names the first param),
        or an item is missing (e.g. 'opt_state' when saved without optimizer).
    """
    self.wait()
    step = _resolve_step(self._mngr, step)
    wanted = {"params": model_tree(model)}
    if optimizer is not None:
      wanted["opt_state"] = optimizer_tree(optimizer)
    restored = _restore_items(self._mngr, step, wanted)
    _apply(model, restored["params"])
    if optimizer is not None:
      _apply(optimizer, restored["opt_state"], skip=("model",))  # restored above, as 'params'
    return read_meta_dict(restored["meta"], f"checkpoint {self.directory} step {step}")

  def wait(self) -> None:
    """Blocks until every started save is committed (re-raises a failed background save)."""
    self._mngr.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases orbax's threads."""
    self._mngr.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


# ---- readers (server, quantizer) --------------------------------------------------


def read_meta(directory: Any, step: int | None = None) -> dict:
  """The meta of `step` (default: latest): step, rng, data_state, config, without any array."""
  mngr = _reader(_path(directory))
  try:
    step = _resolve_step(mngr, step)
    return read_meta_dict(_restore_items(mngr, step, {})["meta"],
                      f"checkpoint {mngr.directory} step {step}")
  finally:
    mngr.close()


def restore_params(directory: Any, model: nnx.Module, step: int | None = None) -> dict:
  """Restores only the 'params' item into `model` (real or abstract), in place; returns meta.

  Each array is read into the sharding of the model's current leaf: a real
  array's sharding, an abstract leaf's `ShapeDtypeStruct.sharding`, or the
  first local device when the leaf has none. A different dtype is cast
  (e.g. a float32 checkpoint into a bfloat16 serving model); shapes must match.
  """
  mngr = _reader(_path(directory))
  try:
    step = _resolve_step(mngr, step)
    restored = _restore_items(mngr, step, {"params": model_tree(model)})
  finally:
    mngr.close()
  _apply(model, restored["params"])
  return read_meta_dict(restored["meta"], f"checkpoint {mngr.directory} step {step}")


def load_model(directory: Any, cfg: Any, *, step: int | None = None,
               mesh: jax.sharding.Mesh | None = None, rules: Any = None) -> nnx.Module:
  """A Horizon model for `cfg` with its parameters read from a checkpoint.

  The model is built abstractly (`model.decoder.abstract_model`, nothing
  allocated) and each array is read straight into its place: sharded by the
  logical-axis rules on `mesh` (`sharding.rules.state_shardings`), or on the
  first local device when mesh is None. No random initialisation happens.
  """
  graphdef, state = nnx.split(abstract_model(cfg))
  if mesh is not None:
    shardings = rules_lib.state_shardings(state, mesh, rules)
  else:
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shardings = jax.tree.map(lambda v: v.replace(jax.tree.map(lambda _: one, v.get_value())),
                             state, is_leaf=_is_var)
  state = jax.tree.map(
      lambda v, s: v.replace(jax.tree.map(_with_sharding, v.get_value(), s.get_value())),
      state, shardings, is_leaf=_is_var)
  model = nnx.merge(graphdef, state)
  restore_params(directory, model, step)
  return model


def _with_sharding(leaf: Any, sharding: jax.sharding.Sharding) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


def _is_var(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


# Model-config fields renamed since a checkpoint format was written: old -> new.
_RENAMED_MODEL_FIELDS = {"attention_impl": "kernels"}


def stored_model_config(directory: Any, fallback: Any, step: int | None = None) -> Any:
  """The ModelConfig a checkpoint was written with (the weights decide the shapes).

  Starts from `fallback` (a `config.model` ConfigDict or mapping) and overrides
  every field the checkpoint's stored config has, so fields added since it
  was written (e.g. `kernels`, `quantization`) take the fallback's value and
  renamed ones are mapped. A checkpoint without a stored config uses
  `fallback` as is.
  """
  from model.config import ModelConfig  # noqa: PLC0415 - keep this module light to import

  merged = fallback.to_dict() if hasattr(fallback, "to_dict") else dict(fallback)
  stored = (read_meta(directory, step).get("config") or {}).get("model")
  if stored:
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    for key, value in stored.items():
      key = _RENAMED_MODEL_FIELDS.get(key, key)
      if key == "kernels" and value not in ("auto", "xla", "pallas"):
        continue
      if key in known:
        merged[key] = value
  cfg = ModelConfig.from_config(merged)
  cfg.validate()
  return cfg
