"""The engine session, the oracle policy and the episode record, against references written out here
(the scripted engine of test_agent_loop_mutants feeds the real OutputProcessor): tiers refused at
session start, the context's last token, seeds, streams that end without a finish, rendering that is
not append-only, images, what counts as a forced token, oracle thinking and call ids, the summary."""

from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest

from rl.agent.episode import Episode, message_to_json, unplayed
from rl.agent.loop import run_episode
from rl.agent.oracle import OraclePolicy, turn_thinking
from rl.agent.policy import EnginePolicy, Sampling, _RecordingProcessor
from serving.chat import ChatRenderer
from serving.types import ImagePart, Message, TextPart
from tests.rl.test_agent_loop import EchoExecutor, _task
from tests.rl.test_agent_loop_mutants import ECHO, SP, TOK, _Engine

FIRST = [Message("user", [TextPart("say done")])]
EOT = ([SP["end_of_turn"]], None, None, None)  # a turn that ends at once


def _session(engine, tier=None, renderer=None, first=FIRST, **sampling):
  policy = EnginePolicy(engine, renderer or ChatRenderer(TOK, 0), {"low": 2})
  return policy.session(_task(), first, [ECHO], tier, Sampling(**sampling))


def test_a_tier_without_a_budget_is_refused_when_the_session_opens():
  with pytest.raises(ValueError, match=r"tier 'high' has no thinking budget; configured tiers: \['low'\]"):
    _session(_Engine([]), tier="high")


def test_one_token_of_room_is_still_asked_for():
  engine = _Engine([EOT])
  session = _session(engine, max_tokens_per_turn=64)
  engine.max_context = len(session.ids) + 1
  comp = asyncio.run(session.complete(FIRST, 0))
  assert engine.requests[0].params.max_tokens == 1 and comp.finish_reason == "stop"


def test_large_seeds_wrap_into_31_bits():
  """seed 3000: 3000 * 1_000_003 = 3_000_009_000 > 2**31; minus 2**31 = 852_525_352, then + turn."""
  engine = _Engine([EOT, EOT])
  session = _session(engine, seed=3000)
  asyncio.run(session.complete(FIRST, 0))
  asyncio.run(session.complete(FIRST, 1))
  assert [r.params.seed for r in engine.requests] == [852_525_352, 852_525_353]


def test_routing_is_asked_for_only_when_the_policy_records_it():
  for record in (True, False):
    engine = _Engine([EOT])
    policy = EnginePolicy(engine, ChatRenderer(TOK, 0), {"low": 2}, record_routing=record)
    asyncio.run(policy.session(_task(), FIRST, [ECHO], None, Sampling()).complete(FIRST, 0))
    assert engine.requests[0].record_routing is record


def test_sampling_defaults():
  s = Sampling()
  assert (s.temperature, s.top_p, s.top_k, s.seed, s.max_tokens_per_turn) == (1.0, 1.0, 0, 0, 256)


def test_a_stream_that_ends_without_a_finish_is_an_error():
  """An engine whose events stop without a finish reason: the episode ends 'error', not 'answer'."""

  class Unfinished(_Engine):
    def submit(self, request, loop):
      self.requests.append(request)

      class Handle:
        async def aevents(self):
          yield types.SimpleNamespace(token_ids=TOK.encode("done"), logprobs=None, finish_reason=None,
                                      usage=None, routing=None)

      return Handle()

  policy = EnginePolicy(Unfinished([]), ChatRenderer(TOK, 0), {"low": 2})
  ep = asyncio.run(run_episode(
    _task(), policy, EchoExecutor(), tier=None, sampling=Sampling()))
  assert (ep.end, ep.error, ep.turns[0].finish_reason) == ("error", "generation ended with 'error'", "error")


def test_append_refuses_a_rendering_that_is_not_append_only():
  class Rewriting(ChatRenderer):
    """Renders the conversation with its first token changed once it has a third message."""

    def render(self, messages, **kw):
      out = super().render(messages, **kw)
      if len(messages) > 2:
        out = types.SimpleNamespace(ids=[out.ids[0] + 1, *out.ids[1:]], images=out.images)
      return out

  engine = _Engine([EOT])
  session = _session(engine, renderer=Rewriting(TOK, 0))
  comp = asyncio.run(session.complete(FIRST, 0))
  with pytest.raises(AssertionError, match="not append-only"):
    session.append(FIRST + [comp.message], [Message("user", [TextPart("go on")])])


def test_images_of_the_first_and_appended_messages_reach_the_engine():
  img0, img1 = np.full((4, 4, 3), 0.25, np.float32), np.full((4, 4, 3), 0.75, np.float32)
  first = [Message("user", [TextPart("look"), ImagePart(img0)])]
  engine = _Engine([EOT, EOT])
  session = _session(engine, renderer=ChatRenderer(TOK, num_image_tokens=2), first=first)
  comp = asyncio.run(session.complete(first, 0))
  messages = first + [comp.message]
  session.append(messages, [Message("user", [TextPart("and this"), ImagePart(img1)])])
  asyncio.run(session.complete(messages, 1))
  got = [r.images for r in engine.requests]
  assert got[0].dtype == np.float32 and got[0].shape == (1, 4, 4, 3) and np.all(got[0] == 0.25)
  assert got[1].shape == (2, 4, 4, 3) and np.all(got[1][0] == 0.25) and np.all(got[1][1] == 0.75)


def test_only_single_id_constraints_count_as_forced():
  """A forced id (int or numpy int, as the engine accepts) is forced; a mask or None is sampled."""

  class Inner:
    def __init__(self):
      self.constraints = [np.int64(7), np.ones(5, bool), None, 3]

    def next_constraint(self):
      return self.constraints.pop(0)

    def feed(self, token_id):
      return [], None

  proc = _RecordingProcessor(Inner())
  for t in range(4):
    proc.next_constraint()
    proc.feed(t)
  assert proc.forced == [True, False, False, True]


def _oracle_episode(turns, tier):
  policy = OraclePolicy({"t0": turns})
  return asyncio.run(run_episode(
    _task(), policy, EchoExecutor(), tier=tier, sampling=Sampling()))


def test_oracle_thinking_at_the_played_tier_and_call_ids_per_turn():
  call = {"name": "echo", "arguments": {"text": "x"}}
  turns = [{"thinking": "plain", "thinking_by_tier": {"high": "long"}, "tool_calls": [call]},
           {"tool_calls": [call]}, {"content": "<answer>done</answer>"}]
  ep = _oracle_episode(turns, "high")
  assert [m.thinking for m in ep.messages if m.role == "assistant"] == ["long", "", ""]
  assert [m.tool_call_id for m in ep.messages if m.role == "tool"] == ["call_0_0", "call_1_0"]
  assert message_to_json(ep.messages[3]) == {"role": "assistant", "content": "", "thinking": "",
                                             "tool_calls": [{"id": "call_1_0", "name": "echo",
                                                             "arguments": '{"text": "x"}'}]}


def test_turn_thinking_keeps_an_empty_tier_entry_and_reads_a_null_map_as_none():
  assert turn_thinking({"thinking": "plain", "thinking_by_tier": {"low": ""}}, "low") == ""
  assert turn_thinking({"thinking": "plain", "thinking_by_tier": None}, "low") == "plain"
  assert turn_thinking({}, "max") == ""


def test_an_empty_trajectory_is_refused_even_when_the_task_has_an_oracle():
  task = _task(oracle=[{"content": "own"}])
  with pytest.raises(ValueError, match="has no oracle trajectory"):
    OraclePolicy({task.id: []}).session(task, [], [], None, Sampling())


def test_summary_holds_every_field_as_recorded():
  ep = Episode("t9", "code", None, reward=0.25, success=False, thinking_tokens=3, generated_tokens=11,
               tool_calls=5, tool_errors=2, malformed_calls=1, wall_s=2.0,
               messages=[Message("assistant", [TextPart("a"), ImagePart(np.zeros((1, 1, 3))),
                                               TextPart("b")])])
  assert ep.summary() == {
    "task_id": "t9", "domain": "code", "tier": None, "reward": 0.25, "success": False, "turns": 1,
    "thinking_tokens": 3, "generated_tokens": 11, "tool_calls": 5, "tool_errors": 2, "malformed_calls": 1,
    "end": "answer", "error": None, "wall_s": 2.0, "final_text": "ab", "grade": {}}
  assert message_to_json(ep.messages[0]) == {"role": "assistant", "content": "ab"}
  assert not unplayed({}) and not unplayed({"end": None})  # a record without an end is not 'error'
