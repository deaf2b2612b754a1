"""What `experiments.evaluate` calls: task sources, policies and the whole evaluation run."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from model.config import ConfigError, is_int
from rl.agent.episode import unplayed
from rl.agent.executor import make_executor
from rl.agent.http import make_http_policy, served_model
from rl.agent.loop import LoopConfig
from rl.agent.policy import EnginePolicy, Sampling
from rl.envs.base import EnvContext
from rl.eval import harness, report
from rl.tasks import generators
from rl.tasks.schema import DOMAINS, Task
from training.checkpoint import read_meta


def generated_tasks(domains: Sequence[str], split: str, difficulty: int, n: int, seed: int = 0) -> list[Task]:
  """`n` tasks per domain from the built-in generators (difficulty capped at each domain's top)."""
  out = []
  for i, domain in enumerate(domains):
    if domain not in DOMAINS:
      raise ConfigError(f"--domains: unknown domain {domain!r}; domains: {', '.join(DOMAINS)}")
    if domain in domains[:i]:  # its tasks twice: refused by the harness, but only after a model loads
      raise ConfigError(f"--domains: {domain!r} is given twice")
    level = min(difficulty, generators.max_difficulty(domain))
    out += generators.generate(domain, split=split, difficulty=level, n=n, seed=seed)
  return out


def engine_policy(config, checkpoint: str | None, step: int | None = None, model_overrides=None):
  """(EnginePolicy, engine) over a checkpoint's step (default latest; or random weights) with
  config.serving's engine; model_overrides: as in `serving.build.build_engine`."""
  from serving.build import build_engine
  from serving.chat import ChatRenderer

  engine = build_engine(config, checkpoint, step, model_overrides).start()
  vision = engine.cfg.vision
  renderer = ChatRenderer(engine.tokenizer, vision.num_patches if vision.enabled else 0)
  return EnginePolicy(engine, renderer, dict(config.serving.thinking_budgets)), engine


def run_evaluation(
  config,
  *,
  tasks: Sequence[Task],
  out_dir: str,
  tiers: Sequence[str | None],
  samples: int,
  concurrency: int,
  checkpoint: str | None = None,
  endpoint: str | None = None,
  api: str = "openai",
  model: str | None = None,
  api_key: str | None = None,
  temperature: float | None = None,
  progress: bool = True,
  model_overrides: dict | None = None,
) -> dict[str, Any]:
  """Evaluates `tasks` with the checkpoint's engine or an endpoint; writes results, table, plot.

  model_overrides: config.model fields set on the command line, for the checkpoint's engine
  (`serving.build.build_engine`).

  Returns {'rows', 'table', 'json', 'results', 'plot'}.
  """
  for flag, value, ok in (("--samples", samples, is_int(samples, numpy=True) and samples >= 1),
                          ("--concurrency", concurrency,
                           is_int(concurrency, numpy=True) and concurrency >= 1),
                          ("--temperature", temperature, temperature is None or (
                              isinstance(temperature, numbers.Real) and not isinstance(temperature, bool)
                              and 0 <= temperature < math.inf))):
    if not ok:  # a bad temperature was refused per request, and every episode scored 0
      raise ConfigError(f"{flag}={value!r}: must be " + ("a finite number >= 0 (0: greedy)." if flag ==
                                                        "--temperature" else "an int >= 1."))
  samples, concurrency = int(samples), int(concurrency)
  temperature = None if temperature is None else float(temperature)
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  results = out / "results.jsonl"
  budgets = dict(config.serving.thinking_budgets)
  if temperature is None:
    temperature = 0.0 if samples == 1 else 1.0
  sampling = Sampling(
    temperature=temperature,
    seed=int(config.env.seed),
    max_tokens_per_turn=int(config.env.max_tokens_per_turn),
  )
  ctx = EnvContext.from_config(config.env)  # checks every config.env knob first
  loop = LoopConfig.from_config(config.env)
  # A checkpoint is pinned to the step it has now: a trainer adding steps meanwhile changes
  # neither this run's weights nor what a resume compares against.
  step = read_meta(checkpoint)["step"] if checkpoint and not endpoint else None
  if endpoint and model is None:  # the model the server lists (GET /v1/models) over the config's name
    model = served_model(api, endpoint, api_key, config.serving.model_name)
  # What decides an episode besides its (task, tier, sample) key: a resumed run must match it,
  # checked before a model is loaded.
  signature = {
    "policy": f"{api}:{endpoint}:{model or config.serving.model_name}" if endpoint
    else f"checkpoint:{checkpoint}@{step}" if checkpoint else "random-init",
    "sampling": dataclasses.asdict(sampling),
    "loop": dataclasses.asdict(loop),
    "thinking_budgets": budgets,
  }
  if model_overrides and not endpoint:  # e.g. another dtype: not the same policy (absent: as before)
    signature["model_overrides"] = dict(sorted(model_overrides.items()))
  harness.check_signature(results, signature, resuming=any("key" in r for r in harness.read_results(results)))
  engine = None
  if endpoint:
    count = None
    try:  # thinking-token counts for Anthropic endpoints (their usage has none): our tokenizer
      from training.tokenizer import default_tokenizer_path, load_tokenizer

      tok = load_tokenizer(config.serving.tokenizer or default_tokenizer_path(config.variant))
      count = lambda text: len(tok.encode(text, allow_special=False))  # noqa: E731
    except (ValueError, OSError):
      pass
    policy = make_http_policy(
      api, endpoint, model or config.serving.model_name, api_key, thinking_budgets=budgets, count_tokens=count
    )
  else:
    policy, engine = engine_policy(config, checkpoint, step, model_overrides)
  executor = make_executor(config.env.executor, ctx, workers=int(config.env.workers))
  start = time.time()
  try:
    records = harness.evaluate(
      tasks,
      policy,
      executor,
      tiers=tiers,
      samples=samples,
      sampling=sampling,
      concurrency=concurrency,
      results=results,
      config=loop,
      progress=progress,
    )
  finally:
    executor.shutdown()
    if engine is not None:
      engine.stop()
  rows, not_played = report.aggregate(records), report.unplayed(records)
  table = report.markdown(rows, not_played)
  (out / "table.md").write_text(table + "\n")
  report.plot(rows, str(out / "success_vs_thinking.png"))
  summary = report.summary_json(rows)
  (out / "summary.json").write_text(summary + "\n")
  meta = {
    "policy": signature["policy"] if checkpoint or endpoint else "checkpoint:random-init",
    "tasks": len(tasks),
    "tiers": [harness.tier_name(t) for t in tiers],
    "samples": samples,
    "temperature": temperature,
    "sampling": dataclasses.asdict(sampling),
    "wall_s": round(time.time() - start, 1),
  }
  (out / "run.json").write_text(json.dumps(meta, indent=2) + "\n")
  return {
    "rows": rows,
    "table": table,
    "json": summary,
    "results": str(results),
    "plot": str(out / "success_vs_thinking.png"),
    "meta": meta,
    "not_played": not_played,  # by domain/tier: episodes the policy failed to play (replayed on resume)
    "first_error": next((r.get("error") for r in records if unplayed(r)), None),
  }
