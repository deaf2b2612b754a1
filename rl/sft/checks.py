"""config.sft checked before anything is played or built, and the SFT data's identity for resume.

`check_sft_config` runs first in `experiments.sft` (and in `SFTBatches`): a bad knob fails in a
second naming `config.sft.<field>` and the fix, not after every domain's oracle episodes were
played, and no value is clamped or silently ignored.

`data_identity` is what an SFT checkpoint's data state records about the data it trained on
(config.sft and the few other knobs that shape the rows); `check_data_state` compares a stored
state with this run's config before the data is built again, naming each field that differs.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from model.config import ConfigError
from rl.sft import data as sft
from rl.tasks import generators
from training.knobs import check_int_knobs

CHAT_TIERS = ("low", "high", "max")


def _items(text: str, field: str) -> list[str]:
  """The comma-separated entries of config.sft.<field>; an entry given twice is an error."""
  out: list[str] = []
  for part in (p.strip() for p in str(text).split(",")):
    if part and part in out:
      raise ConfigError(f"config.sft.{field}={text!r}: {part!r} appears twice; give each once (twice "
                        "would train on its examples twice while the counts say once).")
    if part:
      out.append(part)
  return out


def sft_domains(s: Any) -> list[str]:
  """config.sft.domains -> the generated domains, each known and given once."""
  domains = _items(s.domains, "domains")
  for domain in domains:
    if domain not in generators.DOMAINS:
      raise ConfigError(f"config.sft.domains: unknown domain {domain!r}; domains: "
                        f"{', '.join(generators.DOMAINS)} (comma-separated).")
  return domains


def sft_levels(spec: str, domain: str) -> list[int]:
  """config.sft.difficulties for `domain`: 'all' = each of its levels; '0' / '0,1' = those, each
  within the domain's range (a level past it is an error, not the top level)."""
  top = generators.max_difficulty(domain)
  if str(spec).strip() == "all":
    return list(range(top + 1))
  parts = _items(spec, "difficulties")
  if not parts:
    raise ConfigError(f"config.sft.difficulties={spec!r} is empty; e.g. '0' or '0,1' or 'all'.")
  levels = []
  for part in parts:
    if not re.fullmatch(r"-?[0-9]+", part):  # not isdigit(): '--1' and '²' passed it, then int() failed
      raise ConfigError(f"config.sft.difficulties={spec!r}: {part!r} is not an integer level; e.g. '0', "
                        "'0,1' or 'all'.")
    level = int(part)
    if not 0 <= level <= top:
      raise ConfigError(f"config.sft.difficulties={spec!r}: level {level} is outside {domain}'s levels "
                        f"0..{top}; give levels every domain in config.sft.domains has, or 'all'.")
    levels.append(level)
  return sorted(levels)


def chat_paths(s: Any) -> list[str]:
  """config.sft.chat_files -> the paths, each given once."""
  return _items(s.chat_files, "chat_files")


def check_sft_config(config: Any) -> None:
  """Every config.sft knob, before any task is generated, oracle played or file read."""
  s = config.sft
  check_int_knobs("sft", s, [("tasks_per_level", 1, "train-split tasks per domain and level"),
                             ("task_seed", 0, "the seed of the generated tasks"),
                             ("seed", 0, "example order and batch sampling")])
  domains = sft_domains(s)
  for domain in domains:
    sft_levels(s.difficulties, domain)
  if s.tiers:
    sft.parse_tier_mix(s.tiers, "config.sft.tiers")
  if s.chat_tier and s.chat_tier not in CHAT_TIERS:
    off = " ('' already renders a conversation without reasoning_content with thinking off)" \
        if s.chat_tier == "off" else ""
    raise ConfigError(f"config.sft.chat_tier={s.chat_tier!r}: give one of {', '.join(CHAT_TIERS)}, or '' for "
                      f"'max' where a conversation thinks and thinking off where it does not{off}.")
  if s.tiers and not domains:
    raise ConfigError(f"config.sft.tiers={s.tiers!r} draws tiers for generated tasks' oracles, but "
                      "config.sft.domains is empty; set it, or clear tiers (chat files: "
                      "config.sft.chat_tier).")
  if s.chat_tier and not chat_paths(s):
    raise ConfigError(f"config.sft.chat_tier={s.chat_tier!r} states the tier of chat files, but "
                      "config.sft.chat_files is empty; set it, or clear chat_tier.")
  if not domains and not chat_paths(s):
    raise ConfigError("config.sft.domains and config.sft.chat_files are both empty: nothing to train on; "
                      "set either (e.g. --config.sft.domains=math).")


# ---- the data's identity, for resume ------------------------------------------------------


def data_identity(config: Any) -> dict[str, Any]:
  """The config fields that decide the SFT rows: config.sft and the knobs outside it that shape
  the examples (episode limits, system prompt, thinking budgets, tokenizer, row length)."""
  out = {f"sft.{k}": v for k, v in sorted(config.sft.items())}
  out.update({f"serving.thinking_budgets.{k}": v for k, v in sorted(config.serving.thinking_budgets.items())})
  out.update({"env.max_turns": config.env.max_turns, "env.system_prompt": config.env.system_prompt,
              "data.tokenizer": config.data.get("tokenizer", ""), "train.seq_len": config.train.seq_len})
  return out


class DataDigest:
  """sha256 of the examples in the order they were made, the same on every launch of a config.

  Chat-file examples count whole (their tokens and masks); an oracle example by its task id,
  tier and trained tokens (the oracle's own turns): the tool results between them may differ
  from one launch to the next (a test runner's timings) without the data being other data.
  """

  def __init__(self):
    self._h = hashlib.sha256()

  def add(self, ex: sft.Example, tier: str | None = None, whole: bool = False) -> None:
    self._h.update(f"{ex.source}\0{tier}\0{whole}\0".encode())
    ids = ex.ids if whole else ex.ids[ex.mask == 1]
    self._h.update(np.ascontiguousarray(ids, np.int32).tobytes())
    if whole:
      self._h.update(np.ascontiguousarray(ex.mask, np.int32).tobytes())

  def hexdigest(self) -> str:
    return self._h.hexdigest()


NOT_SFT = ("the checkpoint in this workdir is not an SFT run's; use a new --workdir (pass a pretraining "
           "checkpoint with --config.checkpoint.init_from instead)")


def check_data_state(state: Any, identity: Mapping[str, Any]) -> None:
  """A checkpoint's SFT data state against this run's `data_identity`, before the data is built again.

  Raises naming every field that differs. A state written before the identity was stored (no
  'data' key) passes here; `SFTBatches.set_state` still compares its seed and row count.
  """
  if not (isinstance(state, dict) and state.get("pipeline") == "sft"):
    raise ConfigError(NOT_SFT)
  stored = state.get("data")
  if not isinstance(stored, dict):
    return
  changed = [f"config.{k} (checkpoint {stored[k]!r}, now {identity[k]!r})"  # fields both versions have
             for k in sorted(set(stored) & set(identity)) if stored[k] != identity[k]]
  if changed:
    raise ConfigError(f"this run resumes an SFT checkpoint whose data came from another config: "
                      f"{'; '.join(changed)}. Resume with the checkpoint's values, or train on the new "
                      "data in a new --workdir (--config.checkpoint.init_from=<this workdir>/checkpoints "
                      "starts it from these weights).")
