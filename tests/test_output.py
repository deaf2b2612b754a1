"""OutputProcessor: thinking/answer split, budgets, stop strings, tool-call parsing, robustness.

Token streams are built with the real (tiny) tokenizer, whose few merges split
most words and every multi-byte character over several tokens.
"""

import json
import logging
import re

import numpy as np
import pytest

from serving.output import IncrementalDetokenizer, OutputProcessor
from serving.types import TextDelta, ThinkingDelta, Tool, ToolCallDelta, ToolChoice
from tests.helpers import drive_processor
from training.tokenizer import default_tokenizer_path, load_tokenizer

TOOLS = [Tool("get_weather", "Weather for a city.",
              {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
         Tool("add", "Adds.", {"type": "object", "properties": {"a": {"type": "number"}}})]


@pytest.fixture(scope="module")
def tok():
  return load_tokenizer(default_tokenizer_path("tiny"))


def sp(tok, name):
  return tok.special_id(name)


def enc(tok, text):
  return tok.encode(text)


def run(proc, ids, close_reason="length"):
  """Feeds ids until a finish reason; returns (all deltas incl. close's, reason, per-feed deltas)."""
  steps, reason = [], None
  for i in ids:
    deltas, reason = proc.feed(i)
    steps.append(deltas)
    if reason is not None:
      break
  steps.append(proc.close(reason or close_reason))
  return [d for s in steps for d in s], reason, steps


def texts(deltas, cls):
  return [d.text for d in deltas if isinstance(d, cls)]


def test_thinking_then_text(tok):
  thought, answer = "Let me think: é ≠ e.", "The answer is 4 €."
  ids = enc(tok, thought) + [sp(tok, "/think")] + enc(tok, answer) + [sp(tok, "end_of_turn")]
  proc = OutputProcessor(tok, thinking=True, thinking_budget=None)
  deltas, reason, _ = run(proc, ids)
  assert reason == "stop"
  kinds = [type(d) for d in deltas]
  assert kinds == sorted(kinds, key=lambda k: k is TextDelta)  # all thinking before any text
  assert "".join(texts(deltas, ThinkingDelta)) == thought == proc.thinking_text
  assert "".join(texts(deltas, TextDelta)) == answer == proc.text
  assert proc.thinking_tokens == len(enc(tok, thought)) and proc.tool_calls == []


def test_thinking_off_starts_in_answer_and_drops_stray_specials(tok):
  ids = (enc(tok, "Hi") + [sp(tok, "user"), sp(tok, "/think"), sp(tok, "think"), sp(tok, "image"),
                           sp(tok, "/tool_call"), sp(tok, "tool_result")] + enc(tok, " there") + [tok.eos_id])
  proc = OutputProcessor(tok, thinking=False, thinking_budget=None)
  deltas, reason, _ = run(proc, ids)
  assert reason == "stop" and proc.text == "Hi there" and proc.thinking_text == ""
  assert all(isinstance(d, TextDelta) for d in deltas)


@pytest.mark.parametrize("budget", [0, 1, 7])
def test_budget_forces_end_of_thinking(tok, budget):
  end = sp(tok, "/think")
  filler = enc(tok, "hmm, thinking a lot about this problem here")
  assert len(filler) > budget + 3
  proc = OutputProcessor(tok, thinking=True, thinking_budget=budget)
  for n, i in enumerate(filler):
    c = proc.next_constraint()
    if n == budget:
      assert c == end
      break
    assert c is None, f"forced after {n} thinking tokens; budget is {budget}"
    proc.feed(i)
  assert proc.thinking_tokens == budget
  deltas, reason = proc.feed(end)
  assert reason is None and proc.next_constraint() is None
  assert proc.thinking_text == tok.decode(filler[:budget])
  proc.feed(enc(tok, "A")[0])
  assert proc.next_constraint() is None and proc.text == "A"


def test_budget_counts_dropped_specials(tok):
  proc = OutputProcessor(tok, thinking=True, thinking_budget=3)
  for i in [sp(tok, "user"), enc(tok, "a")[0], sp(tok, "image")]:
    assert proc.next_constraint() is None
    proc.feed(i)
  assert proc.next_constraint() == sp(tok, "/think") and proc.thinking_text == "a"


def test_self_opened_thinking_when_off(tok):
  think, end = sp(tok, "think"), sp(tok, "/think")
  proc = OutputProcessor(tok, thinking=False, thinking_budget=None)
  assert proc.next_constraint() is None
  proc.feed(think)
  assert proc.next_constraint() == end  # budget 0: forced closed at once
  proc.feed(end)
  deltas, _, _ = run(proc, enc(tok, "ok") + [think] + enc(tok, "!"))
  assert proc.text == "ok!" and proc.thinking_tokens == 0 and proc.next_constraint() is None
  proc2 = OutputProcessor(tok, thinking=False, thinking_budget=2)
  for i in [think] + enc(tok, "xy"):
    assert proc2.next_constraint() is None
    proc2.feed(i)
  assert proc2.next_constraint() == end and proc2.thinking_text == "xy"
  late = OutputProcessor(tok, thinking=False, thinking_budget=None)
  run(late, enc(tok, "a") + [think] + enc(tok, "b"))
  assert late.text == "ab" and late.thinking_text == ""


def _stream_with_stops(tok, text, stops):
  proc = OutputProcessor(tok, thinking=False, thinking_budget=None, stop=stops)
  deltas, reason, steps = run(proc, enc(tok, text) + [sp(tok, "end_of_turn")])
  return proc, deltas, reason, steps


@pytest.mark.parametrize("text, stops, want, stop", [
    ("Hello world STOP here", ["STOP", "xyz"], "Hello world ", "STOP"),
    ("abc ### def", ["# d", "###"], "abc ", "###"),  # the first one completed wins
    ("pay 5€€ now", ["€€"], "pay 5", "€€"),
    ("almost STO but not", ["STOP"], "almost STO but not", None),
    ("ends with ST", ["STOP"], "ends with ST", None),
    ("x\n\nObservation: y", ["\nObservation:"], "x\n", "\nObservation:"),
])
def test_stop_strings(tok, text, stops, want, stop):
  proc, deltas, reason, steps = _stream_with_stops(tok, text, stops)
  assert proc.text == want == "".join(texts(deltas, TextDelta)) and proc.stop_sequence == stop
  assert reason == "stop"
  streamed = ""
  for s in steps:
    streamed += "".join(texts(s, TextDelta))
    assert want.startswith(streamed)  # nothing past the cut, ever
  if stop is not None:
    assert len(enc(tok, stop)) > 1  # the tiny tokenizer splits it: the match crosses tokens
    assert proc.feed(enc(tok, "more")[0]) == ([], "stop") and proc.close("stop") == []


def test_stop_strings_ignore_thinking(tok):
  proc = OutputProcessor(tok, thinking=True, thinking_budget=None, stop=["STOP"])
  deltas, reason, _ = run(proc, enc(tok, "no STOP here") + [sp(tok, "/think")] + enc(tok, "a STOP b"))
  assert proc.thinking_text == "no STOP here" and proc.text == "a " and reason == "stop"


def test_stop_holds_back_only_possible_prefixes(tok):
  proc = OutputProcessor(tok, thinking=False, thinking_budget=None, stop=["world!"])
  got = ""
  for i in enc(tok, "hello wor"):
    got += "".join(d.text for d in proc.feed(i)[0])
  assert got == "hello "  # "wor" could start the stop string
  for i in enc(tok, "ld?"):
    got += "".join(d.text for d in proc.feed(i)[0])
  assert got == "hello world?"
  assert proc.close("stop") == [] and proc.stop_sequence is None


def _call_ids(tok, payload):
  return [sp(tok, "tool_call")] + enc(tok, payload) + [sp(tok, "/tool_call")]


def test_tool_calls_parsed(tok):
  c1 = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
  c2 = json.dumps({"name": "add", "arguments": json.dumps({"a": 2.5})})  # arguments as a JSON string
  ids = enc(tok, "Sure.") + _call_ids(tok, c1) + enc(tok, " And ") + _call_ids(tok, c2)
  proc = OutputProcessor(tok, thinking=False, thinking_budget=None, tools=TOOLS, call_id_prefix="toolu_")
  deltas, reason, steps = run(proc, ids + [sp(tok, "end_of_turn")])
  assert reason == "tool_calls"
  calls = [d for d in deltas if isinstance(d, ToolCallDelta)]
  assert [c.index for c in calls] == [0, 1]
  assert [c.call.name for c in calls] == ["get_weather", "add"]
  assert json.loads(calls[0].call.arguments) == {"city": "Paris"}
  assert json.loads(calls[1].call.arguments) == {"a": 2.5}
  assert all(re.fullmatch(r"toolu_[0-9a-f]{24}", c.call.id) for c in calls)
  assert calls[0].call.id != calls[1].call.id
  assert proc.text == "Sure. And " and [c.call for c in calls] == proc.tool_calls
  assert proc.malformed_calls == 0
  assert proc.finish_reason("stop") == "tool_calls" and proc.finish_reason("length") == "length"
  order = [type(d).__name__ for k, d in enumerate(deltas) if k == 0 or type(d) is not type(deltas[k - 1])]
  assert order == ["TextDelta", "ToolCallDelta", "TextDelta", "ToolCallDelta"]
  for s in steps:  # while streaming: no markers, no JSON fragment in any text
    for t in texts(s, TextDelta):
      assert not any(x in t for x in ("<|", "{", '"', "name", "Paris"))


@pytest.mark.parametrize("payload, why", [
    ('{"name": "get_weather", "arguments": {"city": "Par', "not valid JSON"),
    ('{"name": "launch_missiles", "arguments": {}}', "unknown tool"),
    ('{"name": "add", "arguments": [1, 2]}', "must be a JSON object"),
    ('{"name": "add", "arguments": "{oops"}', "is a string but not JSON"),
    ('{"name": "add"}', "exactly the keys"),
    ('{"name": "add", "arguments": {"a": NaN}}', "not valid JSON"),
    ('{"name": "add", "arguments": {"a": 1e999}}', "out of a double's range"),
    ('{"name": "add", "arguments": "{\\"a\\": -1e400}"}', "out of a double's range"),
    ("[" * 5000, "not valid JSON"),
])
def test_malformed_call_becomes_text(tok, caplog, payload, why):
  proc = OutputProcessor(tok, thinking=False, thinking_budget=None, tools=TOOLS)
  with caplog.at_level(logging.WARNING, logger="serving.output"):
    deltas, reason, _ = run(proc, enc(tok, "A ") + _call_ids(tok, payload) + [sp(tok, "end_of_turn")])
  assert reason == "stop" and proc.tool_calls == [] and proc.finish_reason("stop") == "stop"
  assert not any(isinstance(d, ToolCallDelta) for d in deltas)
  assert proc.text == "A " + payload and proc.malformed_calls == 1
  assert any(why in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_unclosed_call_at_close(tok, caplog):
  proc = OutputProcessor(tok, thinking=False, thinking_budget=None, tools=TOOLS)
  partial = '{"name": "add", "arguments": {"a": 1'
  with caplog.at_level(logging.WARNING, logger="serving.output"):
    deltas, reason, steps = run(proc, [sp(tok, "tool_call")] + enc(tok, partial), close_reason="length")
  assert reason is None and all(s == [] for s in steps[:-1])  # nothing streamed while buffering
  assert deltas == [TextDelta(partial)] and proc.text == partial and proc.malformed_calls == 1
  assert "no closing <|/tool_call|>" in caplog.text


def test_special_token_inside_call(tok, caplog):
  good = '{"name": "add", "arguments": {"a": 1}}'
  ids = ([sp(tok, "tool_call")] + enc(tok, '{"name": "ad') + [sp(tok, "user")] + enc(tok, "x")
         + _call_ids(tok, good) + [sp(tok, "end_of_turn")])
  proc = OutputProcessor(tok, thinking=False, thinking_budget=None, tools=TOOLS)
  with caplog.at_level(logging.WARNING, logger="serving.output"):
    deltas, reason, _ = run(proc, ids)
  assert proc.text == '{"name": "adx' and reason == "tool_calls" and proc.malformed_calls == 1
  assert [c.name for c in proc.tool_calls] == ["add"]
  assert "special token <|user|> inside the call" in caplog.text
  # A second <|tool_call|> inside an open call: the first is text, the second parses.
  proc = OutputProcessor(tok, thinking=False, thinking_budget=None, tools=TOOLS)
  with caplog.at_level(logging.WARNING, logger="serving.output"):
    run(proc, [sp(tok, "tool_call")] + enc(tok, "{") + _call_ids(tok, good))
  assert proc.text == "{" and len(proc.tool_calls) == 1 and proc.malformed_calls == 1


def test_stop_string_inside_malformed_call_text(tok):
  proc = OutputProcessor(tok, thinking=False, thinking_budget=None, tools=TOOLS, stop=["END"])
  deltas, reason, _ = run(proc, _call_ids(tok, "junk END more") + enc(tok, "tail"))
  assert reason == "stop" and proc.text == "junk " and proc.stop_sequence == "END"


def test_stop_string_completed_at_close_finishes_stop(tok):
  """An unclosed call cut by max_tokens becomes text at close; a stop string in it cuts it, and the
  finish reason says so (it said 'length' next to a stop_sequence: Anthropic's max_tokens + "END")."""
  proc = OutputProcessor(tok, thinking=False, thinking_budget=None, tools=TOOLS, stop=["END"])
  deltas, reason, _ = run(proc, enc(tok, "Hi ") + [sp(tok, "tool_call")] + enc(tok, '{"name": "END'))
  assert reason is None and proc.text == 'Hi {"name": "' and proc.stop_sequence == "END"
  assert proc.finish_reason("length") == "stop" and proc.finish_reason("error") == "error"


def test_one_call_per_turn_when_parallel_calls_are_off(tok):
  """ToolChoice(parallel=False) (OpenAI parallel_tool_calls=false, Anthropic
  disable_parallel_tool_use; refused / ignored before): once a call closes, the turn ends."""
  c1 = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
  proc = OutputProcessor(tok, thinking=False, thinking_budget=None, tools=TOOLS,
                         tool_choice=ToolChoice("auto", parallel=False))
  assert proc.free_run() is not None  # text and the first call are free
  for i in enc(tok, "Sure.") + _call_ids(tok, c1):
    assert proc.feed(i)[1] is None
  assert [c.name for c in proc.tool_calls] == ["get_weather"]
  assert proc.next_constraint() == sp(tok, "end_of_turn") and proc.free_run() is None
  assert proc.feed(sp(tok, "end_of_turn"))[1] == "tool_calls"
  free = OutputProcessor(tok, thinking=False, thinking_budget=None, tools=TOOLS)  # the default: parallel
  for i in _call_ids(tok, c1):
    free.feed(i)
  assert not isinstance(free.next_constraint(), int) and free.free_run() is not None


def test_tool_choice_none_bans_call_marker(tok):
  proc = OutputProcessor(tok, thinking=True, thinking_budget=2, tools=TOOLS, tool_choice=ToolChoice("none"))
  mask = proc.next_constraint()
  assert mask.dtype == bool and mask.shape == (tok.vocab_size,)
  assert not mask[sp(tok, "tool_call")] and mask.sum() == tok.vocab_size - 1
  proc.feed(enc(tok, "a")[0])
  proc.feed(enc(tok, "b")[0])
  assert proc.next_constraint() == sp(tok, "/think")  # the budget wins over the ban
  proc.feed(sp(tok, "/think"))
  assert not proc.next_constraint()[sp(tok, "tool_call")]


def test_multibyte_chars_delivered_whole(tok):
  text = "a€b😀c ñ 中文"
  ids = enc(tok, text)
  assert len(ids) > len(text)  # characters are split over tokens
  for thinking in (False, True):
    proc = OutputProcessor(tok, thinking=thinking, thinking_budget=None)
    deltas, _, steps = run(proc, ids)
    pieces = [d.text for d in deltas]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    assert sum(1 for s in steps if s) >= 5  # streamed, not delivered once at close


def test_incremental_detokenizer(tok):
  det = IncrementalDetokenizer(tok)
  euro = enc(tok, "€")
  assert len(euro) == 3
  assert det.add(euro[0]) == "" and det.add(euro[1]) == "" and det.add(euro[2]) == "€"
  assert not det.has_pending
  # A genuinely invalid byte is not held forever: it is delivered once text follows.
  lone = enc(tok, "€")[1]  # a continuation byte on its own
  out = det.add(lone) + "".join(det.add(i) for i in enc(tok, "ok"))
  assert out == "\ufffdok"
  assert det.add(euro[0]) == "" and det.flush() == "\ufffd" and det.flush() == ""
  # Garbage never grows the pending ids past 3 tokens.
  for _ in range(20):
    det.add(lone)
  assert len(det._pending) <= 3


def test_bad_arguments(tok):
  with pytest.raises(ValueError, match="thinking_budget"):
    OutputProcessor(tok, thinking=True, thinking_budget=-1)
  with pytest.raises(ValueError, match="stop"):
    OutputProcessor(tok, thinking=True, thinking_budget=None, stop=[""])
  with pytest.raises(ValueError, match="stop"):
    OutputProcessor(tok, thinking=True, thinking_budget=None, stop="STOP")
  with pytest.raises(ValueError, match="needs at least one tool"):
    OutputProcessor(tok, thinking=True, thinking_budget=None, tool_choice=ToolChoice("required"))
  with pytest.raises(ValueError, match="not among the tools"):
    OutputProcessor(tok, thinking=True, thinking_budget=None, tools=TOOLS,
                    tool_choice=ToolChoice("named", "nope"))


def test_random_streams_never_raise(tok):
  rng = np.random.default_rng(1234)
  specials = np.array(sorted(tok.special_ids.values()))
  pieces = [enc(tok, s) for s in ('{"name": "add", "arguments": {"a": 1}}', "STOP", "€", "ab")]
  for trial in range(200):
    n = int(rng.integers(0, 60))
    ids = rng.integers(0, tok.vocab_size, n)
    ids = np.where(rng.random(n) < 0.2, rng.choice(specials, n), ids).tolist()
    for _ in range(int(rng.integers(0, 3))):  # splice in near-valid fragments
      at = int(rng.integers(0, len(ids) + 1))
      ids[at:at] = pieces[int(rng.integers(0, len(pieces)))]
    stops = ["STOP", "b\n"] if trial % 3 == 0 else []
    proc = OutputProcessor(tok, thinking=bool(trial % 2), stop=stops, tools=TOOLS,
                           thinking_budget=[None, 0, 3][trial % 3],
                           tool_choice=ToolChoice("none") if trial % 5 == 0 else ToolChoice())
    deltas, reason = [], None
    for i in ids:
      proc.next_constraint()
      out, reason = proc.feed(i)
      deltas += out
      if reason is not None:
        break
    deltas += proc.close(reason or "length")
    assert proc.close("length") == []
    assert "".join(texts(deltas, TextDelta)) == proc.text
    assert "".join(texts(deltas, ThinkingDelta)) == proc.thinking_text
    assert not any(s in proc.text for s in stops)
    assert reason in (None, "stop", "tool_calls")
    assert [d.call for d in deltas if isinstance(d, ToolCallDelta)] == proc.tool_calls


_drive = drive_processor


@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("named", "add")])
@pytest.mark.parametrize("thinking", [False, True])
def test_constrained_tool_choice(tok, choice, thinking):
  rng = np.random.default_rng(7)
  for _ in range(3):
    proc = OutputProcessor(tok, thinking=thinking, thinking_budget=4, tools=TOOLS, tool_choice=choice)
    if not thinking:  # the constraint starts at once: the first answer token is the call marker
      assert proc.next_constraint() == sp(tok, "tool_call")
    deltas, reason = _drive(proc, rng, enc(tok, "I will call a tool now"))
    assert reason == "tool_calls", [type(d).__name__ for d in deltas]
    calls = [d for d in deltas if isinstance(d, ToolCallDelta)]
    assert len(calls) == 1 and proc.tool_calls == [calls[0].call] and proc.text == ""
    assert not any(isinstance(d, TextDelta) for d in deltas)
    if choice.mode == "named":
      assert calls[0].call.name == "add"
    args = json.loads(calls[0].call.arguments)
    assert isinstance(args, dict)
    if calls[0].call.name == "get_weather":
      assert isinstance(args["city"], str)
    assert proc.thinking_tokens == (4 if thinking else 0)
    assert proc.next_constraint() is None



@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("named", "add")])
def test_forced_call_cut_by_length_is_a_truncated_call(tok, choice):
  """A forced call that max_tokens cuts short is delivered as a truncated call, not as text."""
  proc = OutputProcessor(tok, thinking=False, thinking_budget=None, tools=TOOLS, tool_choice=choice)
  rng, deltas = np.random.default_rng(3), []
  for _ in range(12):
    c = proc.next_constraint()
    token = int(c) if isinstance(c, (int, np.integer)) else int(rng.choice(np.flatnonzero(c)))
    out, reason = proc.feed(token)
    deltas += out
    assert reason is None and out == []  # nothing streams while the call is open
  deltas += proc.close("length")
  (call,) = [d.call for d in deltas if isinstance(d, ToolCallDelta)]
  assert call.truncated and proc.tool_calls == [call] and proc.text == ""
  assert proc.finish_reason("length") == "length"
  assert call.name == "add" if choice.mode == "named" else any(t.name.startswith(call.name) for t in TOOLS)
  assert '{"name": ' not in call.arguments  # only the arguments' JSON so far


def test_both_apis_pass_single_call_requests_on():
  """OpenAI parallel_tool_calls=false (refused with a 400 before) and Anthropic
  disable_parallel_tool_use (accepted and ignored under auto before) reach the processor."""
  from serving.anthropic_request import convert_tool_choice
  from serving.anthropic_schema import ToolChoiceSpec
  from serving.openai_request import ChatRequest, convert_tools
  tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
  body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
  for extra, parallel in (({}, True), ({"parallel_tool_calls": True}, True),
                          ({"parallel_tool_calls": False}, False)):
    _, choice = convert_tools(ChatRequest(**body, **extra), max_tools=8)
    assert (choice.mode, choice.parallel) == ("auto", parallel)
  for spec, parallel in (({"type": "auto"}, True),
                         ({"type": "auto", "disable_parallel_tool_use": True}, False)):
    assert convert_tool_choice(ToolChoiceSpec(**spec), TOOLS).parallel is parallel
