"""The agent loop: one episode = render, generate, parse, execute tools, append, repeat.

Used by RL rollouts, SFT data generation and evaluation alike. An episode ends when the
assistant answers without a tool call, at the task's `max_turns` (assistant messages), or
when the context is full (the token limit). A call the model breaks (bad JSON, an unknown
tool, no closing marker) is answer text, as the APIs deliver it, and ends the episode; it is
counted in `Episode.malformed_calls` (engine policies). Tool failures are tool results, never
exceptions; a policy failure (an HTTP error, an engine error) or an environment that fails
while running tool calls (a dead Ray actor) ends only its own episode, with `end='error'` and
the reason, and is graded like any other end state. An environment that fails to open or reset
(its workspace, its setup) ends its episode the same way, ungraded (reward 0): evaluation leaves
it out and replays it on resume, RL drops its group. A policy that refuses the session (an
unknown tier) is a configuration error and stops the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from rl.agent.episode import Episode, TurnSpan
from rl.agent.executor import Executor
from rl.agent.policy import Policy, Sampling
from rl.envs.base import Grade
from rl.tasks.schema import Task
from serving.types import Message, TextPart

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """default_max_turns: when the task sets none; system_prompt: an optional system message
  (the harness may add one; the first user message is never rewritten)."""

  default_max_turns: int = 8
  system_prompt: str | None = None

  @classmethod
  def from_config(cls, env) -> "LoopConfig":
    """From a config's `env` section (configs/sft.py)."""
    return cls(default_max_turns=int(env.max_turns), system_prompt=env.system_prompt or None)


DEFAULT_LOOP = LoopConfig()


def _turn_end(comp) -> str | None:
  """Why the episode ends after this completion, or None to run its tool calls."""
  if comp.finish_reason in ("error", "cancelled"):
    return "error"
  if comp.finish_reason == "length":
    return "length"
  return None if comp.message.tool_calls else "answer"


async def _run_tools(env, calls, ep: Episode) -> list[Message]:
  results = []
  for call in calls:
    result = await env.execute(call)
    ep.tool_calls += 1
    ep.tool_errors += int(result.error)
    results.append(Message("tool", [TextPart(result.content)], tool_call_id=call.id, name=call.name))
  return results


async def _play(task: Task, session, env, messages: list[Message], ep: Episode, max_turns: int) -> None:
  """The turn loop; sets ep.end (and ep.error) and extends `messages` in place."""
  ep.end = "max_turns"
  for turn in range(max_turns):
    gen_start = len(session.ids) if session.token_level else 0
    try:
      comp = await session.complete(messages, turn)
    except Exception as e:  # the policy failed: this episode ends, the run goes on
      _log.warning("task %s: policy failed on turn %d: %s", task.id, turn, e)
      ep.end, ep.error = "error", f"{type(e).__name__}: {e}"
      return
    messages.append(comp.message)
    ep.thinking_tokens += comp.thinking_tokens
    ep.generated_tokens += comp.generated_tokens
    ep.malformed_calls += comp.malformed_calls
    if session.token_level:
      prompt_start = ep.turns[-1].gen_end if ep.turns else 0
      ep.turns.append(TurnSpan(prompt_start, gen_start, len(session.ids), comp.finish_reason))
    end = _turn_end(comp)
    if end is not None:
      ep.end = end
      if end == "error":
        ep.error = f"generation ended with {comp.finish_reason!r}"
      return
    if turn == max_turns - 1:
      return  # max_turns: the calls of the last allowed turn are not executed
    try:
      results = await _run_tools(env, comp.message.tool_calls, ep)
    except Exception as e:  # the environment itself failed (e.g. its Ray actor died): this episode only
      _log.warning("task %s: the environment failed running tool calls on turn %d: %s", task.id, turn, e)
      ep.end, ep.error = "error", f"environment failed: {type(e).__name__}: {e}"
      return
    session.append(messages, results)
    messages += results
    remaining = session.remaining_tokens()
    if remaining is not None and remaining <= 0:
      ep.end = "length"
      return


def _routing_array(rows, n: int):
  """Per-position routing rows (None = never fed) -> int32 [n, layers, k] with -1 gaps, or None."""
  known = [r for r in rows or () if r is not None]
  if not known:
    return None
  out = np.full((n,) + known[0].shape, -1, np.int32)
  for p, r in enumerate(rows[:n]):
    if r is not None:
      out[p] = r
  return out


async def run_episode(
  task: Task,
  policy: Policy,
  executor: Executor,
  *,
  tier: str | None,
  sampling: Sampling,
  config: LoopConfig = DEFAULT_LOOP,
) -> Episode:
  """Plays `task` to the end with `policy`; returns the graded Episode."""
  start = time.monotonic()
  ep = Episode(task_id=task.id, domain=task.domain, tier=tier)
  try:
    env = await executor.open(task)
  except Exception as e:  # e.g. no Ray actor could be placed: this episode only, as a failed reset
    _log.warning("task %s: opening its environment failed: %s", task.id, e)
    ep.end, ep.error = "error", f"environment failed to open: {type(e).__name__}: {e}"
    ep.wall_s = time.monotonic() - start
    return ep
  session = None
  try:
    try:
      first_text, tools = await env.reset()
    except Exception as e:  # the workspace or its setup failed: not a sample of the policy's behaviour
      _log.warning("task %s: resetting its environment failed: %s", task.id, e)
      ep.end, ep.error = "error", f"environment failed to start: {type(e).__name__}: {e}"
      return ep
    messages: list[Message] = []
    if config.system_prompt:
      messages.append(Message("system", [TextPart(config.system_prompt)]))
    messages.append(Message("user", [TextPart(first_text)]))
    session = policy.session(task, messages, tools, tier, sampling)
    await _play(task, session, env, messages, ep, task.max_turns or config.default_max_turns)
    ep.messages = messages
    try:
      grade = await env.grade(ep.final_text())
    except Exception as e:  # a grader failure is this episode's, not the whole run's
      # A greedy evaluation or a resumed RL step would replay the same episode and fail again,
      # so raising here would stop the run for good; the episode scores 0 and says why.
      _log.exception("grading task %s failed; the episode scores 0", task.id)
      grade = Grade(0.0, False, {"error": f"grading failed: {type(e).__name__}: {e}", "grader_failed": True})
    ep.reward, ep.success, ep.grade = float(grade.reward), bool(grade.success), dict(grade.details)
    if session.token_level:
      ep.token_ids, ep.logprobs, ep.loss_mask = list(session.ids), list(session.logprobs), list(session.mask)
      ep.routing = _routing_array(getattr(session, "routing", None), len(ep.token_ids))
  finally:
    if session is not None:
      session.close()
    try:
      await env.close()
    except Exception:  # e.g. the actor of a failed environment is gone; the episode's result stands
      _log.exception("closing the environment of task %s failed", task.id)
    ep.wall_s = time.monotonic() - start
  return ep


async def run_episodes(
  jobs: Sequence[tuple[Task, str | None, Sampling]],
  policy: Policy,
  executor: Executor,
  *,
  concurrency: int = 32,
  config: LoopConfig = DEFAULT_LOOP,
  on_done: Callable[[int, Episode], None] | None = None,
) -> list[Episode]:
  """Plays many episodes, at most `concurrency` at once; results in job order.

  on_done(index, episode) is called as each finishes (progress bars, result files); at the end,
  `policy.aclose()` frees what the policy holds on this event loop (an HTTP client's connections).
  """
  sem = asyncio.Semaphore(max(1, concurrency))
  out: list[Episode | None] = [None] * len(jobs)

  async def one(i: int) -> None:
    task, tier, sampling = jobs[i]
    async with sem:
      out[i] = await run_episode(task, policy, executor, tier=tier, sampling=sampling, config=config)
    if on_done is not None:
      on_done(i, out[i])

  try:
    await asyncio.gather(*(one(i) for i in range(len(jobs))))
  finally:
    await policy.aclose()
  return out
