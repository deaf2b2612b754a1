"""How an episode ends, what it counts and records, against references written out here: scripted
sessions ending 'cancelled' or 'length', the episode's summary and JSON, oracle turns per tier,
concurrency and executors (each test names the mistake it catches)."""

from __future__ import annotations

import asyncio
import threading
import types

import numpy as np

from rl.agent import loop
from rl.agent.episode import Episode, TurnSpan, message_to_json, unplayed
from rl.agent.executor import TimedExecutor, make_executor
from rl.agent.oracle import OraclePolicy, turn_message
from rl.agent.policy import Completion, Policy, Sampling, Session
from rl.envs.base import Grade
from serving.types import Message, TextPart, ToolCall
from tests.rl.test_agent_loop import EchoExecutor, _task


class _Session(Session):
  """Plays the given completions in order; `room` is what remaining_tokens() says after each turn."""

  def __init__(self, completions, room=None):
    self.completions, self.room, self.appended = list(completions), list(room or []), []

  async def complete(self, messages, turn):
    return self.completions.pop(0)

  def append(self, before, new):
    self.appended.append((len(before), [m.role for m in new]))

  def remaining_tokens(self):
    return self.room.pop(0) if self.room else None


class _Policy(Policy):
  def __init__(self, *completions, room=None):
    self.sessions, self.completions, self.room = [], completions, room

  def session(self, task, first, tools, tier, sampling):
    self.sessions.append(_Session(self.completions, self.room))
    return self.sessions[-1]


def _call(text="a"):
  return ToolCall(f"c_{text}", "echo", f'{{"text": "{text}"}}')


def _comp(reason, calls=(), text="", thinking_tokens=0, generated=0, malformed=0):
  return Completion(Message("assistant", [TextPart(text)], tool_calls=list(calls)), reason,
                    thinking_tokens=thinking_tokens, generated_tokens=generated, malformed_calls=malformed)


def _run(policy, task=None, **kw):
  return asyncio.run(loop.run_episode(task or _task(), policy, EchoExecutor(), tier=None,
                                      sampling=Sampling(), **kw))


def test_cancelled_and_error_generations_end_in_error():
  for reason in ("cancelled", "error"):
    ep = _run(_Policy(_comp(reason, [_call()])))
    assert (ep.end, ep.error, ep.tool_calls) == ("error", f"generation ended with {reason!r}", 0)
    assert unplayed(ep) and unplayed(ep.summary())


def test_length_ends_without_running_the_calls_and_is_not_an_error():
  ep = _run(_Policy(_comp("tool_calls", [_call("x")]), _comp("length", [_call("y")], "cut")))
  assert (ep.end, ep.error, ep.tool_calls, ep.num_turns) == ("length", None, 1, 2)
  assert not unplayed(ep) and ep.final_text() == "cut"


def test_counts_are_summed_over_turns_and_results_follow_the_assistant_turn():
  first = _comp("tool_calls", [_call("a"), _call("b")], thinking_tokens=3, generated=10, malformed=1)
  policy = _Policy(first, _comp("stop", text="done", thinking_tokens=4, generated=6, malformed=2))
  ep = _run(policy, config=loop.LoopConfig(system_prompt="sys"))
  assert (ep.thinking_tokens, ep.generated_tokens, ep.malformed_calls, ep.tool_calls) == (7, 16, 3, 2)
  # append(before, new): `before` is system, user, assistant (3 messages), `new` the two results
  assert policy.sessions[0].appended == [(3, ["tool", "tool"])]
  tools = [m for m in ep.messages if m.role == "tool"]
  assert [(m.tool_call_id, m.name, m.content[0].text) for m in tools] == [
    ("c_a", "echo", "A"), ("c_b", "echo", "B")]
  assert ep.success and ep.turns == []  # not token-level: no spans


def test_the_loop_stops_when_the_context_is_full_after_the_results():
  """remaining_tokens() == 0 after appending ends 'length' at once (a further turn would be empty)."""
  policy = _Policy(_comp("tool_calls", [_call()]), _comp("stop", text="done"), room=[0])
  ep = _run(policy)
  assert (ep.end, ep.num_turns, ep.tool_calls) == ("length", 1, 1)
  policy = _Policy(_comp("tool_calls", [_call()]), _comp("stop", text="done"), room=[1])
  assert _run(policy).end == "answer"


def test_the_tasks_max_turns_wins_over_the_default():
  calls = [_comp("tool_calls", [_call()]) for _ in range(4)]
  ep = _run(_Policy(*calls), _task(max_turns=3), config=loop.LoopConfig(default_max_turns=1))
  assert (ep.end, ep.num_turns, ep.tool_calls) == ("max_turns", 3, 2)
  ep = _run(_Policy(*calls), config=loop.LoopConfig(default_max_turns=2))
  assert (ep.end, ep.num_turns, ep.tool_calls) == ("max_turns", 2, 1)
  env = types.SimpleNamespace(max_turns="5", system_prompt="")
  assert loop.LoopConfig.from_config(env) == loop.LoopConfig(default_max_turns=5, system_prompt=None)


def test_routing_rows_fill_gaps_with_minus_one():
  row = np.array([[1, 2]], np.int32)
  assert loop._routing_array([None, None], 2) is None and loop._routing_array(None, 3) is None
  out = loop._routing_array([row, None, row * 3, row * 4], 3)  # a row past n is dropped
  assert out.dtype == np.int32 and out.tolist() == [[[1, 2]], [[-1, -1]], [[3, 6]]]


def test_episodes_run_concurrently_in_job_order_with_their_index():
  """`concurrency` episodes at once (two here meet inside grading); on_done gets the job's index."""
  barrier = threading.Barrier(2, timeout=5)

  class Meeting(EchoExecutor):
    async def open(self, task):
      handle = await super().open(task)
      grade = handle.grade

      async def meet(text):
        await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
        return await grade(text)

      handle.grade = meet
      return handle

  tasks = [_task(f"t{i}") for i in range(4)]
  policy = OraclePolicy({t.id: [{"content": f"<answer>{t.id}</answer>"}] for t in tasks})
  done = []
  eps = asyncio.run(loop.run_episodes([(t, None, Sampling()) for t in tasks], policy, Meeting(),
                                      concurrency=2, on_done=lambda i, ep: done.append((i, ep.task_id))))
  assert [ep.task_id for ep in eps] == ["t0", "t1", "t2", "t3"]
  assert [ep.grade for ep in eps] == [{"seen": f"<answer>t{i}</answer>"} for i in range(4)]  # none timed out
  assert sorted(done) == [(0, "t0"), (1, "t1"), (2, "t2"), (3, "t3")]


class _Slow(EchoExecutor):
  """Opening and grading each take 0.1 s; grading gives partial credit without success."""

  async def open(self, task):
    await asyncio.sleep(0.1)
    handle = await super().open(task)

    async def grade(text):
      await asyncio.sleep(0.1)
      return Grade(0.5, False, {"partial": True})

    handle.grade = grade
    return handle


def test_timed_executor_sums_open_and_calls_over_episodes():
  """busy_s adds every episode's open and handle calls (3 x 0.2 s here); the reward is the grader's
  and success its own verdict, not reward > 0."""
  executor = TimedExecutor(_Slow())
  tasks = [_task(f"t{i}") for i in range(3)]
  policy = OraclePolicy({t.id: [{"content": "done"}] for t in tasks})
  eps = asyncio.run(loop.run_episodes([(t, None, Sampling()) for t in tasks], policy, executor))
  assert all(ep.wall_s >= 0.2 and (ep.reward, ep.success, ep.grade) == (0.5, False, {"partial": True})
             for ep in eps)
  assert 0.6 <= executor.busy_s <= sum(ep.wall_s for ep in eps)
  assert make_executor("thread", workers=3).pool._max_workers == 3


def test_oracle_thinking_per_tier_and_call_ids():
  turn = {"thinking": "plain", "thinking_by_tier": {"high": "long"}, "content": "c",
          "tool_calls": [{"name": "echo", "arguments": {"text": "x"}}] * 2}
  assert turn_message(turn, 3, True, "high").thinking == "long"
  assert turn_message(turn, 3, True, "low").thinking == "plain"
  msg = turn_message(turn, 3, False, "high")
  assert msg.thinking is None and [c.id for c in msg.tool_calls] == ["call_3_0", "call_3_1"]
  task = _task(oracle=[{"content": "own"}])
  policy = OraclePolicy({task.id: [{"content": "given", "thinking": "t"}]})
  ep = _run(policy, task)
  assert ep.final_text() == "given" and ep.messages[-1].thinking is None  # tier None: thinking off


def test_oracle_answers_empty_past_its_script_and_ends_with_stop():
  policy = OraclePolicy({"t0": [{"tool_calls": [{"name": "echo", "arguments": {"text": "q"}}]}]})
  ep = _run(policy)
  assert ep.end == "answer" and ep.num_turns == 2 and ep.final_text() == "" and ep.tool_calls == 1
  session = policy.session(_task(), [], [], "low", Sampling())
  first, past = asyncio.run(session.complete([], 0)), asyncio.run(session.complete([], 1))
  assert (first.finish_reason, past.finish_reason, past.message.thinking) == ("tool_calls", "stop", None)


def test_summary_and_message_json():
  ep = Episode("t", "math", "low", messages=[
    Message("user", [TextPart("q")]), Message("assistant", [TextPart("first")], thinking=""),
    Message("tool", [TextPart("r")], tool_call_id="c1", name="echo"),
    Message("assistant", [TextPart("a" * 500 + "x" * 2000)])], wall_s=1.23456,
    grade={"n": 2, "ok": True, "why": "w", "rows": [1]}, turns=[TurnSpan(0, 1, 2, "stop")])
  s = ep.summary()
  assert s["final_text"] == "x" * 2000 and s["turns"] == 2 and s["wall_s"] == 1.2346
  assert s["grade"] == {"n": 2, "ok": True, "why": "w"}
  assert message_to_json(ep.messages[1]) == {"role": "assistant", "content": "first", "thinking": ""}
  assert message_to_json(ep.messages[2]) == {"role": "tool", "content": "r", "tool_call_id": "c1",
                                             "name": "echo"}
  assert not unplayed({"end": "length"}) and unplayed({"end": "error"})
