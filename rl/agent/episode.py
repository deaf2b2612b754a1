"""What one episode records: the token stream with its masks, the messages, the outcome.

Token-level fields exist when the policy is the in-process engine (RL needs them); an HTTP
policy records messages and counts only. The token stream is append-only: turn t+1's prompt
is exactly turn t's prompt, then turn t's completion tokens as sampled, then the rendered
tool results and the next generation prompt -- the model's tokens are never re-tokenized,
so the trainer scores exactly what the policy saw (and earlier thinking is never dropped).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from serving.types import Message, TextPart


@dataclasses.dataclass
class TurnSpan:
  """One assistant turn inside `Episode.token_ids`: [prompt_start, gen_start) is what the
  environment and renderer appended before it (the first turn: the whole prompt),
  [gen_start, gen_end) what the policy generated."""

  prompt_start: int
  gen_start: int
  gen_end: int
  finish_reason: str


def unplayed(episode: "Episode | dict[str, Any]") -> bool:
  """True for an episode the policy failed to play (end 'error': a server down, a rejected
  request, an engine failure): not a sample of the policy's behaviour. Evaluation leaves it out
  of every score and replays it on resume; RL does not train on its group. Takes an Episode or
  its results record (a dict)."""
  end = episode.get("end") if isinstance(episode, dict) else episode.end
  return end == "error"


@dataclasses.dataclass
class Episode:
  """One task played to the end.

  Attributes:
    task_id, domain, tier: what was played (tier None = thinking off).
    token_ids: the whole token stream (engine policy only; else empty).
    logprobs: per token, the policy's log-probability of a sampled token; 0.0 elsewhere.
    loss_mask: per token, 1 for tokens the model sampled, 0 for the prompt, tool results,
      generation prompts and tokens the engine forced (e.g. <|/think|> at the budget).
    turns: the span of every assistant turn in `token_ids`.
    routing: with an engine policy that records routing, int32 [len(token_ids), MoE layers, k]:
      the experts each token was routed to when the engine first fed it (-1 where never fed,
      e.g. the last token); None otherwise.
    messages: the conversation as played (system, user, assistant, tool, ...).
    reward, success, grade: the grader's verdict on the end state.
    thinking_tokens, generated_tokens: totals over turns (from usage for HTTP policies).
    tool_calls, tool_errors: counts over the episode.
    malformed_calls: tool calls the model broke (bad JSON, unknown tool, unclosed), which end
      the turn as answer text (engine policies only; see rl.agent.policy.Completion).
    end: why it ended: 'answer' (a turn without tool calls), 'max_turns', 'length' (the
      token limit), 'error' (the policy failed; `error` says how).
    wall_s: wall-clock seconds from reset to grade.
  """

  task_id: str
  domain: str
  tier: str | None
  token_ids: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  loss_mask: list[int] = dataclasses.field(default_factory=list)
  turns: list[TurnSpan] = dataclasses.field(default_factory=list)
  routing: Any = None
  messages: list[Message] = dataclasses.field(default_factory=list)
  reward: float = 0.0
  success: bool = False
  grade: dict[str, Any] = dataclasses.field(default_factory=dict)
  thinking_tokens: int = 0
  generated_tokens: int = 0
  tool_calls: int = 0
  tool_errors: int = 0
  malformed_calls: int = 0
  end: str = "answer"
  error: str | None = None
  wall_s: float = 0.0

  @property
  def num_turns(self) -> int:
    return sum(m.role == "assistant" for m in self.messages)

  def final_text(self) -> str:
    """The answer text of the last assistant message (never its thinking)."""
    for m in reversed(self.messages):
      if m.role == "assistant":
        return "".join(p.text for p in m.content if isinstance(p, TextPart))
    return ""

  def summary(self) -> dict[str, Any]:
    """A JSON-able record for result files (no token arrays)."""
    return {
      "task_id": self.task_id,
      "domain": self.domain,
      "tier": self.tier,
      "reward": self.reward,
      "success": self.success,
      "turns": self.num_turns,
      "thinking_tokens": self.thinking_tokens,
      "generated_tokens": self.generated_tokens,
      "tool_calls": self.tool_calls,
      "tool_errors": self.tool_errors,
      "malformed_calls": self.malformed_calls,
      "end": self.end,
      "error": self.error,
      "wall_s": round(self.wall_s, 4),
      "final_text": self.final_text()[-2000:],
      "grade": {k: v for k, v in self.grade.items() if isinstance(v, (int, float, str, bool))},
    }


def message_to_json(m: Message) -> dict[str, Any]:
  """A message as plain JSON (text parts only; images are not kept in episode logs)."""
  out: dict[str, Any] = {
    "role": m.role,
    "content": "".join(p.text for p in m.content if isinstance(p, TextPart)),
  }
  if m.thinking is not None:
    out["thinking"] = m.thinking
  if m.tool_calls:
    out["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls]
  if m.tool_call_id is not None:
    out["tool_call_id"] = m.tool_call_id
  if m.name is not None:
    out["name"] = m.name
  return out
