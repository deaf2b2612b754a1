"""Runs an evaluation: every task x tier x sample through a policy; one JSONL line per episode.

Results are appended (and flushed) as episodes finish, keyed by (task id, tier, sample), so
an interrupted run started again with the same `--results` file plays only what is missing.
The report (rl/eval/report.py) is computed from the file, not from memory, so a resumed run
reports the whole evaluation. What decides an episode beyond its key (the policy, sampling,
turn and token limits: the caller's `signature`) is kept beside the file, and a run whose
signature differs refuses to resume rather than mix its episodes with the old ones; each record
also holds its task's content hash, so a task changed under the same id is refused too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from model.config import ConfigError
from rl.agent.episode import message_to_json, unplayed
from rl.agent.executor import Executor
from rl.agent.loop import DEFAULT_LOOP, LoopConfig, run_episodes
from rl.agent.policy import Policy, Sampling
from rl.tasks.schema import Task

GREEDY = Sampling(temperature=0.0)
TIER_OFF = "off"  # how a thinking-off run is written in results and tables


def tier_name(tier: str | None) -> str:
  return TIER_OFF if tier is None else tier


def parse_tiers(text: str, field: str = "--tiers") -> list[str | None]:
  """'low,high,max' -> tiers; 'off' (or 'none') is thinking off; each at most once; errors name `field`."""
  out: list[str | None] = []
  for part in (p.strip() for p in text.split(",") if p.strip()):
    if part not in ("off", "none", "low", "high", "max"):
      raise ConfigError(f"{field}: unknown tier {part!r}; use low, high, max or off")
    tier = None if part in ("off", "none") else part
    if tier in out:  # played twice under one key, each episode would count twice in the report
      raise ConfigError(f"{field}: tier {tier_name(tier)!r} is given twice")
    out.append(tier)
  if not out:
    raise ConfigError(f"{field} is empty; e.g. {field}=low,high,max")
  return out


def job_key(task_id: str, tier: str | None, sample: int) -> str:
  return f"{task_id}|{tier_name(tier)}|{sample}"


def iter_results(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
  """(line number, record) of each record of a results file; none if there is no file.

  A line cut by a crash is skipped: that episode is played again. A resume ends the cut line
  and appends after it, so such a line may sit anywhere; the latest record of a key counts.
  """
  path = Path(path)
  if not path.exists():
    return
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      try:
        yield lineno, json.loads(line)
      except json.JSONDecodeError:
        continue


def read_results(path: str | os.PathLike) -> list[dict[str, Any]]:
  """The records of a results file (`iter_results`, without line numbers)."""
  return [r for _, r in iter_results(path)]


def _jobs(tasks, tiers, samples: int, sampling: Sampling, task_tier_wins: bool):
  """(task, tier, sampling) per episode and its result key, in a fixed order."""
  if samples < 1:
    raise ConfigError(f"samples must be >= 1; got {samples}")
  ids = [t.id for t in tasks]
  if len(set(ids)) != len(ids):
    raise ConfigError("task ids must be unique within an evaluation")
  tiers = list(tiers)
  if len(set(tiers)) != len(tiers):
    raise ConfigError(f"tiers must be unique; got {[tier_name(t) for t in tiers]}")
  jobs, keys = [], []
  for task in tasks:
    task_tiers = [task.tier] if (task_tier_wins and task.tier) else tiers
    for tier in task_tiers:
      for i in range(samples):
        keys.append(job_key(task.id, tier, i))
        jobs.append((task, tier, dataclasses.replace(sampling, seed=sampling.seed + i)))
  return jobs, keys


def evaluate(
  tasks: Sequence[Task],
  policy: Policy,
  executor: Executor,
  *,
  tiers: Sequence[str | None],
  samples: int = 1,
  sampling: Sampling = GREEDY,
  concurrency: int = 8,
  results: str | os.PathLike,
  config: LoopConfig = DEFAULT_LOOP,
  progress: bool = True,
  task_tier_wins: bool = False,
  transcripts: bool = True,
  signature: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
  """Plays what `results` lacks and returns every record for these tasks, tiers and samples.

  Args:
    tiers: tiers to evaluate (None = thinking off); with `task_tier_wins`, a task's own
      `tier` field replaces them for that task.
    samples: episodes per task and tier (pass@k up to k = samples); sample i uses seed
      `sampling.seed + i`.
    transcripts: keep each episode's messages in its record (what an evaluator reads first
      when a number surprises them).
    signature: JSON-able settings that decide an episode besides its key (`check_signature`).
  """
  jobs, keys = _jobs(tasks, tiers, samples, sampling, task_tier_wins)
  wanted = set(keys)
  hashes = {t.id: task_hash(t) for t in tasks}
  recorded = read_results(results)
  _check_tasks_unchanged(recorded, wanted, hashes, results)
  # An episode the policy failed to play (a server down) is played again.
  done = {r["key"] for r in recorded if "key" in r and not unplayed(r)}
  if signature is not None:
    check_signature(results, signature, resuming=any("key" in r for r in recorded))
  todo = [i for i, k in enumerate(keys) if k not in done]
  Path(results).parent.mkdir(parents=True, exist_ok=True)
  bar = _bar(len(keys), len(keys) - len(todo), progress)
  _end_torn_line(results)
  with open(results, "a", encoding="utf-8") as out:

    def on_done(j: int, episode) -> None:
      record = {
        "key": keys[todo[j]],
        "sample": int(keys[todo[j]].rsplit("|", 1)[1]),
        **episode.summary(),
        "tier": tier_name(episode.tier),
        "task_hash": hashes[episode.task_id],
      }
      if transcripts:
        record["messages"] = [message_to_json(m) for m in episode.messages]
      out.write(json.dumps(record) + "\n")
      out.flush()
      if bar is not None:
        bar.update(1)

    if todo:
      asyncio.run(
        run_episodes(
          [jobs[i] for i in todo], policy, executor, concurrency=concurrency, config=config, on_done=on_done
        )
      )
  if bar is not None:
    bar.close()
  latest = {}
  for r in read_results(results):
    if r.get("key") in wanted:
      latest[r["key"]] = r
  return [latest[k] for k in keys if k in latest]


def task_hash(task: Task) -> str:
  """A digest of everything about a task that can decide its episode (all but `meta`)."""
  content = {k: v for k, v in task.to_json().items() if k != "meta"}
  return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def _check_tasks_unchanged(records: list[dict[str, Any]], wanted: set[str], hashes: dict[str, str],
                           results: str | os.PathLike) -> None:
  """Refuses to resume over a recorded episode of a task whose content has changed since.

  A task file regenerated or edited under the same ids (another answer, other files) would
  otherwise keep its old episodes and report them as this evaluation's. Records from before
  task hashes were written are accepted.
  """
  for r in records:
    if r.get("key") in wanted and "task_hash" in r:
      task_id = r["key"].rsplit("|", 2)[0]
      if r["task_hash"] != hashes[task_id]:
        raise ConfigError(f"{results}: task {task_id!r} has changed since its episode was recorded there "
                          "(another prompt, answer, files or limits under the same id); evaluate into a new "
                          "--out, or remove the file to start over.")


def signature_path(results: str | os.PathLike) -> Path:
  """Where the settings that played a results file are kept: `<results>.signature.json`."""
  return Path(f"{results}.signature.json")


def check_signature(results: str | os.PathLike, signature: dict[str, Any], *, resuming: bool) -> None:
  """Records `signature` beside `results`; refuses to resume a file played with other settings.

  An evaluation re-run into the same output resumes (plays only missing keys), so episodes
  played with, say, max_tokens_per_turn=0 would otherwise be reported beside new ones played
  with 256. A file from before signatures were kept is resumed as it is and then signed.
  """
  path = signature_path(results)
  new = json.loads(json.dumps(signature, sort_keys=True))  # the form it is stored in
  if resuming and path.exists():
    old = json.loads(path.read_text(encoding="utf-8"))
    if old != new:
      diffs = [f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in sorted(set(old) | set(new))
               if old.get(k) != new.get(k)]
      raise ConfigError(f"{results} holds episodes played with other settings ({'; '.join(diffs)}); "
                        "resuming would mix them. Write to a fresh output directory, or delete the "
                        "results file and its .signature.json to play every episode again.")
    return
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(new, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _end_torn_line(path: str | os.PathLike) -> None:
  """A crash may leave a last line without its newline; new records must not join it."""
  path = Path(path)
  if path.exists() and path.stat().st_size:
    with open(path, "rb+") as f:
      f.seek(-1, os.SEEK_END)
      if f.read(1) != b"\n":
        f.write(b"\n")


def _bar(total: int, initial: int, enabled: bool):
  if not enabled:
    return None
  from tqdm import tqdm

  return tqdm(total=total, initial=initial, desc="episodes", unit="ep", dynamic_ncols=True)
