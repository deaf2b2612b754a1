"""A scripted policy that plays fixed trajectories (a task's oracle) through the agent loop.

Running the oracle through the real loop and environment yields the real tool results, so
the played conversation is exactly what SFT trains on and what the oracle tests replay.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rl.agent.policy import Completion, Policy, Sampling, Session
from rl.tasks.schema import Task
from serving.types import Message, TextPart, ToolCall


def turn_thinking(turn: Mapping[str, Any], tier: str | None) -> str:
  """The turn's thinking at `tier`: its `thinking_by_tier` entry, else its one `thinking`."""
  return (turn.get("thinking_by_tier") or {}).get(tier, turn.get("thinking", ""))


def turn_message(turn: Mapping[str, Any], index: int, thinking: bool, tier: str | None = None) -> Message:
  """An oracle turn as an assistant Message (call ids call_<turn>_<i>), thinking at `tier`."""
  calls = [
    ToolCall(id=f"call_{index}_{i}", name=c["name"], arguments=json.dumps(c["arguments"]))
    for i, c in enumerate(turn.get("tool_calls", []))
  ]
  return Message(
    "assistant",
    [TextPart(turn.get("content", ""))],
    thinking=turn_thinking(turn, tier) if thinking else None,
    tool_calls=calls,
  )


class ScriptedSession(Session):
  """Returns the scripted turns in order (then empty answers)."""

  def __init__(self, turns: Sequence[Mapping[str, Any]], thinking: bool, tier: str | None = None):
    self.turns, self.thinking, self.tier = list(turns), thinking, tier

  async def complete(self, messages, turn: int) -> Completion:
    if turn >= len(self.turns):
      return Completion(Message("assistant", [TextPart("")]), "stop")
    message = turn_message(self.turns[turn], turn, self.thinking, self.tier)
    return Completion(message, "tool_calls" if message.tool_calls else "stop")


class OraclePolicy(Policy):
  """Plays each task's `oracle`, or the turns given for its id in `trajectories`."""

  def __init__(self, trajectories: Mapping[str, Sequence[Mapping[str, Any]]] | None = None):
    self.trajectories = dict(trajectories or {})

  def session(self, task: Task, first, tools, tier, sampling: Sampling) -> Session:
    turns = self.trajectories.get(task.id, task.oracle)
    if not turns:
      raise ValueError(
        f"task {task.id!r} has no oracle trajectory (generated tasks have one; pass trajectories= for others)"
      )
    return ScriptedSession(turns, tier is not None, tier)
