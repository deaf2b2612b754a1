"""The SFT batch source: oracle trajectories and chat files, rendered, masked, packed.

It has the interface of the training loop's batch sources (training/batches.py): `start`,
`batch(step)`, `get_state` / `set_state`, `summary`; `training.loop.run(..., batches=...)`
runs it with the one training loop (checkpoints, resume, metrics, NaN policy). Rows are
addressed by (seed, step, row), so resuming needs no iterator state; with several processes every
one takes process 0's rows, so they build the same global batch.

Oracle conversations are played through the agent loop with the real environments (so tool
results are what the tools return), at the tier whose thinking budget holds the oracle's
thinking (`data.tier_for_thinking`), or with config.sft.tiers at a tier drawn per task with
the oracle's thinking for that tier (`thinking_by_tier`: e.g. math's result alone at low,
the working at high, each column counted unit by unit at max): the model learns to think as deep as
the tier it is told. A task drawn at 'off' is played and rendered with thinking off (the oracle's
answers and tool calls without its thinking), as the agent loop runs tier None.

config.sft is checked (`checks.check_sft_config`) before any task is generated, and a resumed
run's data state (`get_state`: config.sft's identity and a digest of the examples) is compared with
the config before the data is built again (`checks.check_data_state`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import jax
import numpy as np

from model.config import ConfigError
from rl.agent.executor import ThreadExecutor
from rl.agent.loop import LoopConfig, run_episodes
from rl.agent.oracle import OraclePolicy, turn_thinking
from rl.agent.policy import Sampling
from rl.envs.base import EnvContext
from rl.sft import checks
from rl.sft import data as sft
from rl.tasks import generators
from rl.train.multiprocess import gather_objects
from serving.chat import ChatRenderer
from training import byte_corpus

_log = logging.getLogger(__name__)


def oracle_conversations(tasks, ctx: EnvContext, config: LoopConfig, budgets: dict[str, int], tokenizer,
                         workers: int = 8, tiers: dict[str, float] | None = None, seed: int = 0):
  """(messages, tools, tier, task) per task, played with its oracle through the environments.

  tiers: None = each task at the smallest tier whose budget holds its oracle's thinking; a mix
  {tier: weight} = a tier drawn per task (seeded by `seed` and its position), its thinking the
  oracle's `thinking_by_tier` entry where it has one, and the smallest fitting tier instead
  when that thinking exceeds the drawn tier's budget; 'off' = thinking off (tier None).
  Only trajectories that succeed are kept (a generator bug must not teach a wrong answer).
  """
  tools_of: dict[str, list] = {}
  names = sorted(tiers or {})
  p = np.array([tiers[t] for t in names]) if tiers else None

  def longest(task, tier) -> int:
    return max((len(tokenizer.encode(turn_thinking(t, tier), allow_special=False)) for t in task.oracle),
               default=0)

  plain: dict[str, list] = {}  # tasks played with their one default thinking, whatever the tier

  def tier_of(i, task) -> str | None:
    if tiers:
      drawn = names[np.random.default_rng([seed, i, 5]).choice(len(names), p=p / p.sum())]
      if drawn == "off":
        return None  # played and rendered with thinking off, as the agent loop runs tier None
      if drawn in budgets and longest(task, drawn) <= budgets[drawn]:
        return drawn
    # the smallest tier holding the default thinking, played with that thinking (not the tier's)
    plain[task.id] = [{k: v for k, v in t.items() if k != "thinking_by_tier"} for t in task.oracle]
    return sft.tier_for_thinking(longest(task, None), budgets)

  jobs = [(t, tier_of(i, t), Sampling()) for i, t in enumerate(tasks)]
  executor = ThreadExecutor(ctx, workers=workers)

  class _Recorder(OraclePolicy):
    def session(self, task, first, tools, tier, sampling):
      tools_of[task.id] = list(tools)
      return super().session(task, first, tools, tier, sampling)

  try:
    episodes = asyncio.run(run_episodes(jobs, _Recorder(plain), executor, concurrency=workers, config=config))
  finally:
    executor.shutdown()
  out, failed = [], 0
  for (task, tier, _), ep in zip(jobs, episodes, strict=True):
    if not ep.success:
      failed += 1
      continue
    out.append((ep.messages, tools_of[task.id], tier, task))
  if failed:
    _log.warning("SFT: %d of %d oracle trajectories did not succeed and were left out", failed, len(jobs))
  return out


def chat_examples(path: str, renderer: ChatRenderer, chat_tier: str | None) -> list[sft.Example]:
  """The rendered conversations of one chat JSONL file (config.sft.chat_files); every error
  names file:line, and a file without conversations is an error."""
  out = []
  for messages, tools, untrained, where in sft.load_chat_jsonl(path):
    tier = chat_tier
    if tier is None and sft.uses_thinking(messages):
      tier = "max"
    try:
      out.append(sft.render_example(renderer, messages, tools, tier, source=where, untrained=untrained))
    except ValueError as e:  # the chat format's own checks (tool ids, names, schemas)
      raise sft.ChatDataError(f"{where}: {e}") from None
  if not out:
    raise sft.ChatDataError(f"config.sft.chat_files: {path} holds no conversations (one JSON "
                            "conversation per line); remove it from the list or fill it.")
  return out


class SFTBatches:
  """Packed SFT rows from config.sft: generated-task oracles and OpenAI-format chat files."""

  pipeline = "sft"
  per_process_state = False  # batches are addressed by step (process 0's rows): any count resumes

  def __init__(self, config, mesh: jax.sharding.Mesh, tc, tokenizer, renderer: ChatRenderer,
               ctx: EnvContext, loop: LoopConfig):
    checks.check_sft_config(config)  # every knob, before any task is generated or played
    self.mesh, self.tc, self.seed = mesh, tc, int(config.sft.seed)
    self.identity = checks.data_identity(config)
    s = config.sft
    examples: list[sft.Example] = []
    self.counts: dict[str, int] = {}
    self.tiers: dict[str, int] = {}  # oracle examples per tier ('off': thinking off)
    digest = checks.DataDigest()
    budgets = dict(config.serving.thinking_budgets)
    tiers = sft.parse_tier_mix(s.tiers, "config.sft.tiers") if s.tiers else None
    # Chat files are read (and any error in them raised) before minutes of oracle episodes;
    # their examples still follow the oracles', as before.
    chats = {p: chat_examples(p, renderer, s.chat_tier or None) for p in checks.chat_paths(s)}
    for domain in checks.sft_domains(s):
      for level in checks.sft_levels(s.difficulties, domain):
        tasks = generators.generate(domain, split="train", difficulty=level, n=int(s.tasks_per_level),
                                    seed=int(s.task_seed))
        played = oracle_conversations(tasks, ctx, loop, budgets, tokenizer, workers=int(config.env.workers),
                                      tiers=tiers, seed=int(s.task_seed) * 1009 + level)
        for messages, tools, tier, task in played:
          examples.append(sft.render_example(renderer, messages, tools, tier, source=task.id))
          digest.add(examples[-1], tier)
          self.tiers[tier or "off"] = self.tiers.get(tier or "off", 0) + 1
        self.counts[f"{domain}/{level}"] = len(played)
    for path, rendered in chats.items():
      examples += rendered
      for ex in rendered:
        digest.add(ex, whole=True)
      self.counts[path] = len(rendered)
    order = np.random.default_rng(self.seed).permutation(len(examples))
    self.stats = sft.PackStats()
    self.rows = list(sft.pack((examples[i] for i in order), tc.seq_len, self.stats))
    if jax.process_count() > 1:
      # Tool results can differ between processes (a test runner's timings: "in 0.012s" is a token
      # longer than "in 0.001s"), and then so would the packing: every process trains on process
      # 0's rows, so they all build one global batch.
      self.rows = gather_objects(self.rows if jax.process_index() == 0 else [])[0]
    if not self.rows:
      raise ConfigError("config.sft gave no training rows: set sft.domains and/or sft.chat_files "
                        f"(counts: {self.counts}, dropped as longer than seq_len={tc.seq_len}: "
                        f"{self.stats.dropped_too_long})")
    if self.stats.dropped_too_long:
      _log.warning("SFT: %d examples longer than seq_len+1=%d tokens were dropped; raise "
                   "config.train.seq_len to keep them", self.stats.dropped_too_long, tc.seq_len + 1)
    self.digest = digest.hexdigest()

  def start(self) -> None:
    pass

  def batch(self, step: int) -> dict[str, jax.Array]:
    tc, rows = self.tc, self.rows

    def make_rows(indices: np.ndarray) -> dict[str, np.ndarray]:
      picked = [rows[sft.row_index(len(rows), self.seed, step, tc.global_batch, int(j))] for j in indices]
      return {k: np.stack([r[k] for r in picked]) for k in picked[0]}

    return byte_corpus.global_batch(self.mesh, tc.global_batch, tc.seq_len, make_rows)

  @staticmethod
  def check_state(config, state: Any) -> None:
    """A checkpoint's data state against `config`, before the data is built (names what differs)."""
    checks.check_data_state(state, checks.data_identity(config))

  def get_state(self) -> dict[str, Any]:
    return {"pipeline": "sft", "seed": self.seed, "rows": len(self.rows), "data": self.identity,
            "digest": self.digest}

  def set_state(self, state: Any) -> None:
    checks.check_data_state(state, self.identity)
    if state["seed"] != self.seed or state["rows"] != len(self.rows):
      raise ConfigError(f"the checkpoint's SFT data had seed {state['seed']} and {state['rows']} rows, this "
                        f"run {self.seed} and {len(self.rows)}: resume with the same config.sft")
    if state.get("digest", self.digest) != self.digest:
      raise ConfigError("the SFT data built now differs from the data of the checkpoint this run resumes, "
                        "though the config that shapes it is the same: a chat file's contents or the task "
                        "generators or their oracles changed. Restore them, or train on the new data in a "
                        "new --workdir (--config.checkpoint.init_from=<this workdir>/checkpoints starts it "
                        "from these weights).")

  def summary(self) -> dict[str, Any]:
    st = self.stats
    return {"sft_examples": st.examples, "sft_rows": st.rows, "sft_dropped_too_long": st.dropped_too_long,
            "data_tokens": st.tokens, "sft_target_tokens": st.target_tokens, "sft_sources": self.counts,
            "sft_tiers": self.tiers, "prepared_dir": None}

