"""The recorded episode of the engine policy, against token streams written out here: each turn's
tokens, log-probs and loss mask exactly as the engine produced them, forced tokens out of the loss,
the tool results and generation prompt appended after them, spans, counts and routing rows.

The engine is scripted (as in test_malformed_calls): it feeds each request's real OutputProcessor a
fixed sequence (the stop token is not fed), so the session and loop code are the real ones."""

from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest

from rl.agent.loop import run_episode
from rl.agent.policy import EnginePolicy, Sampling
from serving.chat import ChatRenderer
from serving.types import Message, TextPart
from tests.rl.test_agent_loop import ECHO, EchoExecutor, _task
from training.tokenizer import default_tokenizer_path, load_tokenizer

TOK = load_tokenizer(default_tokenizer_path("tiny"))
SP = {n: TOK.special_id(n) for n in ("assistant", "think", "/think", "tool", "tool_call", "/tool_call",
                                     "tool_result", "/tool_result", "end_of_turn")}
CALL = '{"name": "echo", "arguments": {"text": "hi"}}'


class _Engine:
  """turns: (ids, logprobs or None, usage or None, routing value or None[, finish reason]) per request."""

  def __init__(self, turns, max_context=4096):
    self.tokenizer, self.max_context, self.turns = TOK, max_context, list(turns)
    self.requests = []

  def submit(self, request, loop):
    ids, lps, usage, route, *finish = self.turns.pop(0)
    finish = finish[0] if finish else "stop"
    self.requests.append(request)
    proc = request.processor
    fed = ids[:-1] if finish == "stop" else ids  # a stop token is not fed; a cut turn's last token is
    for t in fed:
      proc.next_constraint()
      proc.feed(t)
    proc.close(finish)
    n = len(request.prompt_ids) + len(ids) - 1  # positions fed by this request
    routing = None if route is None else np.full((n, 1, 1), route, np.int32)

    class Handle:
      async def aevents(self):  # the tokens in two events, the last carrying the finish
        yield types.SimpleNamespace(token_ids=ids[:-1], logprobs=lps and lps[:-1], finish_reason=None,
                                    usage=None, routing=None)
        yield types.SimpleNamespace(token_ids=ids[-1:], logprobs=lps and lps[-1:], finish_reason=finish,
                                    usage=usage, routing=routing)

    return Handle()


def _play(turns, tier="low", budget=2, **engine_kw):
  engine = _Engine(turns, **engine_kw)
  policy = EnginePolicy(engine, ChatRenderer(TOK, num_image_tokens=0), {"low": budget}, record_routing=True)
  task = _task()
  sampling = Sampling(temperature=0.7, top_p=0.9, top_k=5, seed=4, max_tokens_per_turn=64)
  ep = asyncio.run(run_episode(task, policy, EchoExecutor(), tier=tier, sampling=sampling))
  return ep, engine


def _prompt(tier="low"):
  """The first prompt: system (tools, effort), user, then <|assistant|><|think|> (+<|/think|> off)."""
  return ChatRenderer(TOK, 0).render([Message("user", [TextPart("say done")])], tools=[ECHO], effort=tier,
                                     thinking=tier is not None).ids


THOUGHT = TOK.encode("xy")  # as many thinking tokens as the budget: </think> is then forced
TURN1 = THOUGHT + [SP["/think"], SP["tool_call"], *TOK.encode(CALL), SP["/tool_call"], SP["end_of_turn"]]
RESULT = [SP["tool"], SP["tool_result"], *TOK.encode('{"name": "echo", "content": "HI"}'), SP["/tool_result"],
          SP["end_of_turn"], SP["assistant"], SP["think"]]
OK = TOK.encode("ok")  # as long as THOUGHT: its </think> is forced too
TURN2 = OK + [SP["/think"], *TOK.encode("<answer>done</answer>"), SP["end_of_turn"]]


def test_the_stream_is_prompt_turns_and_results_with_their_logprobs_and_mask():
  """Catches a turn's tokens re-rendered or shifted, tool results rendered after the wrong messages,
  log-probs or masks misaligned (a missing log-prob read as nothing), a forced </think> in the loss,
  spans off by one, a per-turn count kept instead of the episode's sum."""
  lp1 = [-0.1 * (k + 1) for k in range(len(TURN1))]
  turns = [(TURN1, lp1, types.SimpleNamespace(completion_tokens=40), 3), (TURN2, None, None, 7)]
  ep, engine = _play(turns, budget=len(THOUGHT))
  p0 = _prompt()
  want = p0 + TURN1 + RESULT + TURN2
  assert ep.token_ids == want and ep.end == "answer" and ep.success
  g1, e1 = len(p0), len(p0) + len(TURN1)
  g2 = e1 + len(RESULT)
  assert ep.logprobs == [0.0] * g1 + lp1 + [0.0] * len(RESULT) + [0.0] * len(TURN2)
  forced = len(THOUGHT)  # the </think> the budget forced
  assert ep.loss_mask == ([0] * g1 + [1] * forced + [0] + [1] * (len(TURN1) - forced - 1) + [0] * len(RESULT)
                          + [1] * len(OK) + [0] + [1] * (len(TURN2) - len(OK) - 1))
  assert [(s.prompt_start, s.gen_start, s.gen_end, s.finish_reason) for s in ep.turns] == [
    (0, g1, e1, "tool_calls"), (e1, g2, len(want), "stop")]
  assert engine.requests[1].prompt_ids == p0 + TURN1 + RESULT  # turn 2 continues the stream as sampled
  # thinking: the budget's tokens in each turn; generated: usage, else the count
  assert len(OK) == len(THOUGHT) == 2 and ep.thinking_tokens == 4
  assert ep.generated_tokens == 40 + len(TURN2) and ep.tool_calls == 1
  assert ep.messages[1].thinking == "xy" and ep.messages[3].thinking == "ok"
  # routing: each position keeps the experts of the request that first fed it; the last token none
  assert ep.routing.shape == (len(want), 1, 1)
  assert ep.routing[:, 0, 0].tolist() == [3] * (e1 - 1) + [7] * (len(want) - e1) + [-1]


def test_each_turn_is_seeded_and_the_budget_is_the_tiers():
  turns = [(TURN1, None, None, None), (TURN2, None, None, None)]
  ep, engine = _play(turns, budget=len(THOUGHT))
  assert ep.routing is None  # no request recorded routing
  params = [r.params for r in engine.requests]
  assert [p.seed for p in params] == [4 * 1_000_003, 4 * 1_000_003 + 1]
  assert (params[0].temperature, params[0].top_p, params[0].top_k, params[0].max_tokens) == (
    pytest.approx(0.7), pytest.approx(0.9), 5, 64)
  assert engine.requests[0].processor.inner._budget == len(THOUGHT)


def test_thinking_off_prompt_and_no_thinking_recorded():
  answer = TOK.encode("<answer>done</answer>") + [SP["end_of_turn"]]
  ep, engine = _play([(answer, None, None, None)], tier=None)
  p0 = _prompt(None)
  assert p0[-3:] == [SP["assistant"], SP["think"], SP["/think"]]
  assert engine.requests[0].prompt_ids == p0 and ep.messages[-1].thinking is None
  assert ep.loss_mask == [0] * len(p0) + [1] * (len(ep.token_ids) - len(p0))


def test_a_turn_ended_by_eos_gets_its_end_of_turn_before_the_results():
  """The stop token here is <|eos|>, not <|end_of_turn|>: the format's end of turn is appended
  (out of the loss) before the tool results."""
  eos = TOK.special_id("eos")
  turn1 = [SP["/think"], SP["tool_call"], *TOK.encode(CALL), SP["/tool_call"], eos]
  ep, _ = _play([(turn1, None, None, None), (TURN2, None, None, None)], tier=None)
  p0 = _prompt(None)
  e1 = len(p0) + len(turn1)
  assert ep.token_ids[:e1 + 1] == p0 + turn1 + [SP["end_of_turn"]]
  assert ep.loss_mask[e1 - 1:e1 + 1] == [1, 0] and ep.turns[1].prompt_start == e1


def test_context_limit_clamps_a_turn_and_a_full_context_ends_with_length():
  """A turn asks for min(max_tokens_per_turn, context left); once the results fill the context the
  episode ends 'length' without another request."""
  p0 = _prompt(None)
  turn1 = [SP["/think"], SP["tool_call"], *TOK.encode(CALL), SP["/tool_call"], SP["end_of_turn"]]
  full = len(p0) + len(turn1) + len(RESULT) + 1  # the results and <|/think|> fill it exactly
  ep, engine = _play([(turn1, None, None, None)], tier=None, max_context=full)
  assert engine.requests[0].params.max_tokens == min(64, full - len(p0))
  assert ep.end == "length" and ep.error is None and len(engine.requests) == 1 and ep.num_turns == 1
  assert len(ep.token_ids) == full and ep.tool_calls == 1


def test_a_turn_the_engine_cut_at_its_limit_ends_the_episode_length():
  cut = [SP["/think"], *TOK.encode("<answer>do")]
  ep, _ = _play([(cut, None, None, None, "length")], tier=None)
  assert (ep.end, ep.error, ep.turns[0].finish_reason) == ("length", None, "length")
  assert ep.final_text() == "<answer>do" and ep.loss_mask[-len(cut):] == [1] * len(cut)


def test_a_full_context_asks_the_engine_for_nothing():
  """With no room left a turn is 'length' at once, no request made; with room, the turn's limit is
  clamped to it."""
  engine = _Engine([(TURN2, None, None, None)])
  policy = EnginePolicy(engine, ChatRenderer(TOK, 0), {"low": 2})
  first = [Message("user", [TextPart("say done")])]
  session = policy.session(_task(), first, [ECHO], None, Sampling(max_tokens_per_turn=64))
  engine.max_context = len(session.ids)
  comp = asyncio.run(session.complete(first, 0))
  assert (comp.finish_reason, comp.token_ids, engine.requests) == ("length", [], [])
  engine.max_context = len(session.ids) + 5
  asyncio.run(session.complete(first, 0))
  assert engine.requests[0].params.max_tokens == 5
