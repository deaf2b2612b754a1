"""Policies the agent loop plays: the in-process engine, or an HTTP endpoint (rl/agent/http.py).

A policy opens one `Session` per episode. The loop hands the session the first messages, asks
it for completions, and appends tool results; the session keeps whatever state its kind of
policy needs. `EngineSession` keeps the episode's token stream itself: each turn's prompt is
the previous prompt + the tokens the engine sampled + the rendered new messages, never a
re-rendering of the whole conversation, so the stream is append-only and carries per-token
log-probabilities and a loss mask.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from rl.tasks.schema import Task
from serving.chat import ChatRenderer
from serving.engine import Engine, Request
from serving.output import OutputProcessor
from serving.types import Message, SamplingParams, TextPart, Tool


@dataclasses.dataclass
class Completion:
  """One assistant turn.

  message: the parsed assistant message (thinking, text, tool calls).
  finish_reason: 'stop' | 'tool_calls' | 'length' | 'error' | 'cancelled'.
  malformed_calls: tool calls the model opened but broke (bad JSON, an unknown tool, no
    closing marker), delivered as answer text (engine policies only: the APIs return them as
    text, as vLLM's parsers do, so an HTTP policy cannot tell them from an answer).
  token_ids / logprobs / forced: the sampled tokens (engine policies only).
  """

  message: Message
  finish_reason: str
  thinking_tokens: int = 0
  generated_tokens: int = 0
  malformed_calls: int = 0
  token_ids: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  forced: list[bool] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Sampling:
  """Per-episode sampling: temperature 0 = greedy; seed + turn index seeds each turn."""

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int = 0
  max_tokens_per_turn: int = 256


class Session(abc.ABC):
  """One episode's view of a policy."""

  #: whether `Completion.token_ids` and the session's token stream are recorded
  token_level: bool = False

  @abc.abstractmethod
  async def complete(self, messages: Sequence[Message], turn: int) -> Completion:
    """The next assistant turn for `messages` (ending with a user or tool message)."""

  def append(self, messages_before: Sequence[Message], new: Sequence[Message]) -> None:  # noqa: B027 (an optional hook: a no-op by default)
    """`new` (tool results) were appended after `messages_before` (which ends with the
    assistant turn just completed)."""

  def remaining_tokens(self) -> int | None:
    """Tokens the context still holds, or None when the policy does not know."""
    return None

  def close(self) -> None:  # noqa: B027 (an optional hook: a no-op by default)
    """Frees what the session holds."""


class Policy(abc.ABC):
  """Opens sessions. `tier` None = thinking off; else low | high | max."""

  @abc.abstractmethod
  def session(
    self, task: Task, first: Sequence[Message], tools: Sequence[Tool], tier: str | None, sampling: Sampling
  ) -> Session:
    """A session for one episode of `task` starting from the messages `first`."""

  async def aclose(self) -> None:  # noqa: B027 (an optional hook: a no-op by default)
    """Frees what the policy holds on the running event loop (run_episodes calls it at its end);
    the policy stays usable and opens them again on its next session."""


class _RecordingProcessor:
  """Wraps the server's OutputProcessor to record which fed tokens the engine was forced to
  take (a constraint that is a single id, e.g. <|/think|> at the thinking budget): those get
  loss mask 0, since the policy did not choose them."""

  def __init__(self, inner: OutputProcessor):
    self.inner = inner
    self.forced: list[bool] = []
    self._pending = False

  def next_constraint(self):
    constraint = self.inner.next_constraint()
    self._pending = isinstance(constraint, (int, np.integer))
    return constraint

  def free_run(self):
    self._pending = False  # a free run's tokens are sampled, never forced
    return self.inner.free_run()

  def feed(self, token_id: int):
    self.forced.append(self._pending)
    self._pending = False
    return self.inner.feed(token_id)

  def close(self, reason: str):
    return self.inner.close(reason)


class EnginePolicy(Policy):
  """The in-process `serving.engine.Engine`: episodes run concurrently through its slots.

  Args:
    engine: a started Engine.
    renderer: the chat renderer of the engine's tokenizer.
    thinking_budgets: tier -> thinking tokens (config.serving.thinking_budgets).
  """

  def __init__(self, engine: Engine, renderer: ChatRenderer, thinking_budgets: Mapping[str, int],
               record_routing: bool = False):
    self.engine, self.renderer = engine, renderer
    self.budgets = dict(thinking_budgets)
    self.record_routing = record_routing
    self.end_of_turn = engine.tokenizer.special_id("end_of_turn")

  def session(self, task, first, tools, tier, sampling) -> "EngineSession":
    if tier is not None and tier not in self.budgets:
      raise ValueError(f"tier {tier!r} has no thinking budget; configured tiers: {sorted(self.budgets)}")
    return EngineSession(self, first, tools, tier, sampling)


class EngineSession(Session):
  """Keeps the append-only token stream of one episode (see the module docstring)."""

  token_level = True

  def __init__(
    self,
    policy: EnginePolicy,
    first: Sequence[Message],
    tools: Sequence[Tool],
    tier: str | None,
    sampling: Sampling,
  ):
    self.policy, self.tools, self.tier, self.sampling = policy, list(tools), tier, sampling
    self.thinking = tier is not None
    rendered = self._render(first, add_generation_prompt=True)
    self.images = rendered.images
    self.ids: list[int] = list(rendered.ids)
    self.logprobs: list[float] = [0.0] * len(self.ids)
    self.mask: list[int] = [0] * len(self.ids)
    # record_routing: each position's MoE experts [layers, k] from the request that first fed it
    # (what a prefix-cached engine would reuse); None until some request has fed it.
    self.routing: list[np.ndarray | None] = []

  def _render(self, messages, *, add_generation_prompt: bool):
    return self.policy.renderer.render(
      messages,
      tools=self.tools,
      effort=self.tier,
      thinking=self.thinking,
      add_generation_prompt=add_generation_prompt,
    )

  def remaining_tokens(self) -> int:
    return self.policy.engine.max_context - len(self.ids)

  async def complete(self, messages: Sequence[Message], turn: int) -> Completion:
    policy, s = self.policy, self.sampling
    max_tokens = min(s.max_tokens_per_turn, self.remaining_tokens())
    if max_tokens < 1:
      return Completion(Message("assistant", [TextPart("")]), "length")
    processor = _RecordingProcessor(
      OutputProcessor(
        policy.engine.tokenizer,
        thinking=self.thinking,
        thinking_budget=policy.budgets[self.tier] if self.thinking else None,
        tools=self.tools,
      )
    )
    params = SamplingParams(
      max_tokens=max_tokens,
      temperature=s.temperature,
      top_p=s.top_p,
      top_k=s.top_k,
      seed=(s.seed * 1_000_003 + turn) % (2**31),
    )
    pixels = np.stack([np.asarray(im, np.float32) for im in self.images]) if self.images else None
    handle = policy.engine.submit(
      Request(prompt_ids=list(self.ids), params=params, images=pixels, processor=processor,
              record_routing=policy.record_routing),
      loop=asyncio.get_running_loop(),
    )
    token_ids, logprobs, reason, usage, routing = [], [], "error", None, None
    async for ev in handle.aevents():
      token_ids += ev.token_ids
      logprobs += ev.logprobs or [0.0] * len(ev.token_ids)
      if ev.finish_reason is not None:
        reason, usage, routing = ev.finish_reason, ev.usage, ev.routing
    inner = processor.inner
    forced = processor.forced + [False] * (len(token_ids) - len(processor.forced))  # the stop token
    message = Message(
      "assistant",
      [TextPart(inner.text)],
      thinking=inner.thinking_text if self.thinking else None,
      tool_calls=list(inner.tool_calls),
    )
    self.ids += token_ids
    self.logprobs += logprobs
    self.mask += [0 if f else 1 for f in forced]
    if routing is not None:
      self.routing += [None] * (len(self.ids) - len(self.routing))
      for p in range(min(len(routing), len(self.ids))):
        if self.routing[p] is None:
          self.routing[p] = routing[p]
    return Completion(
      message,
      inner.finish_reason(reason),
      thinking_tokens=inner.thinking_tokens,
      generated_tokens=usage.completion_tokens if usage else len(token_ids),
      malformed_calls=inner.malformed_calls,
      token_ids=token_ids,
      logprobs=logprobs,
      forced=forced,
    )

  def append(self, messages_before: Sequence[Message], new: Sequence[Message]) -> None:
    """Appends the rendering of `new` plus the next generation prompt.

    The suffix is render(before + new) minus render(before): the chat format is append-only,
    so it depends on `new` alone (and the tool-call ids in `before`); the tokens already in
    the stream, the model's own, are kept as sampled.
    """
    if self.ids and self.ids[-1] != self.policy.end_of_turn:
      # the turn ended without its end-of-turn token (EOS): close it as the format requires
      self._extend([self.policy.end_of_turn])
    before = self._render(messages_before, add_generation_prompt=False).ids
    after = self._render(list(messages_before) + list(new), add_generation_prompt=True)
    if after.ids[: len(before)] != before:
      raise AssertionError("chat rendering is not append-only for these messages")
    self.images = after.images
    self._extend(after.ids[len(before) :])

  def _extend(self, ids: Sequence[int]) -> None:
    self.ids += list(ids)
    self.logprobs += [0.0] * len(ids)
    self.mask += [0] * len(ids)
