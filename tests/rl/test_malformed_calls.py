"""A tool call the model breaks (bad JSON, an unknown tool, no closing marker) ends the turn as
answer text, as vLLM's parsers deliver it; the episode, the RL metrics and the evaluation table
count it, so a policy that learns to break its calls is visible rather than scored as wrong answers.

The engine here is scripted: it feeds each request's real OutputProcessor a fixed token sequence
the way `serving.engine.Engine` does (the stop token is not fed), so the session, loop and report
code under test are the real ones."""

from __future__ import annotations

import asyncio
import types

from rl.agent.loop import run_episode
from rl.agent.policy import EnginePolicy, Sampling
from rl.eval import report
from serving.chat import ChatRenderer
from tests.rl.test_agent_loop import EchoExecutor, _task
from training.tokenizer import default_tokenizer_path, load_tokenizer


class _ScriptedEngine:
  def __init__(self, turns: list[list[int]]):
    self.tokenizer = load_tokenizer(default_tokenizer_path("tiny"))
    self.max_context = 4096
    self.turns = list(turns)

  def submit(self, request, loop):
    ids = self.turns.pop(0)
    proc = request.processor
    for t in ids[:-1]:  # the last id is the stop token, which the engine never feeds
      proc.next_constraint()
      proc.feed(t)
    proc.close("stop")

    class Handle:
      async def aevents(self):
        yield types.SimpleNamespace(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop",
                                    usage=None, routing=None)

    return Handle()


def _ids(tok, *pieces):
  """Token ids of a turn: str pieces are encoded, others are special-token names in a tuple."""
  out = []
  for p in pieces:
    out += [tok.special_id(p[0])] if isinstance(p, tuple) else tok.encode(p)
  return out


def _play(turns_fn):
  engine = _ScriptedEngine([])
  engine.turns = turns_fn(engine.tokenizer)
  policy = EnginePolicy(engine, ChatRenderer(engine.tokenizer, num_image_tokens=0), {"low": 8})
  return asyncio.run(run_episode(_task(), policy, EchoExecutor(), tier=None, sampling=Sampling()))


def test_a_broken_call_ends_the_episode_as_text_and_is_counted():
  def turns(tok):
    good = '{"name": "echo", "arguments": {"text": "hi"}}'
    bad = '{"name": "echo", "arguments": {"text": }'
    return [
      _ids(tok, ("tool_call",), good, ("/tool_call",), ("end_of_turn",)),
      _ids(tok, "ok ", ("tool_call",), bad, ("/tool_call",), ("end_of_turn",)),
    ]

  ep = _play(turns)
  assert ep.tool_calls == 1 and ep.tool_errors == 0 and ep.malformed_calls == 1
  assert ep.end == "answer" and not ep.success and ep.num_turns == 2
  assert ep.final_text() == 'ok {"name": "echo", "arguments": {"text": }'
  summary = ep.summary()
  assert summary["malformed_calls"] == 1 and summary["tool_calls"] == 1


def test_unknown_tool_and_unclosed_call_are_counted_per_turn():
  def turns(tok):
    unknown = '{"name": "nope", "arguments": {}}'
    return [
      _ids(tok, ("tool_call",), unknown, ("/tool_call",), ("tool_call",), '{"name": "echo"',
           ("end_of_turn",)),
    ]

  ep = _play(turns)
  # the unknown tool's call is text; the second call is still open at the stop token: also text
  assert ep.malformed_calls == 2 and ep.tool_calls == 0 and ep.end == "answer"


def test_clean_episodes_count_none_and_the_report_averages_them():
  def turns(tok):
    return [_ids(tok, "<answer>done</answer>", ("end_of_turn",))]

  ep = _play(turns)
  assert ep.malformed_calls == 0 and ep.success
  records = [dict(ep.summary(), malformed_calls=m, task_id=f"t{m}", tier="off") for m in (0, 1, 3)]
  old = dict(ep.summary(), task_id="old", tier="off")
  del old["malformed_calls"]  # a results file written before the field existed reads as 0
  rows = {(r["domain"], r["tier"]): r for r in report.aggregate(records + [old])}
  assert rows[("math", "off")]["malformed_calls"] == (0 + 1 + 3 + 0) / 4
  table = report.markdown(list(rows.values()))
  assert "bad calls" in table.splitlines()[0] and "| 1.00 |" in table
