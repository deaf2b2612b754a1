"""serving.output edge cases that mutation testing found unchecked.

Each test pins one behaviour that a small source change (a mutant) altered without any other
test failing. Expected values are written out by hand.
"""

import base64
import json

import pytest

from serving.output import IncrementalDetokenizer, OutputProcessor, _StopMatcher
from serving.types import ResponseFormat, TextDelta, Tool, ToolCallDelta, ToolChoice
from training.tokenizer import default_tokenizer_path, load_tokenizer, tokenizer_from_bytes

TOOLS = [Tool("get_weather", "Weather for a city.",
              {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})]


@pytest.fixture(scope="module")
def tok():
  return load_tokenizer(default_tokenizer_path("tiny"))


def sp(tok, name):
  return tok.special_id(name)


def feed_all(proc, ids):
  deltas = []
  for i in ids:
    out, reason = proc.feed(i)
    deltas += out
    if reason is not None:
      return deltas, reason
  return deltas, None


def test_detokenizer_never_emits_a_head_the_full_text_contradicts():
  """A token that ends one character and starts the next (bytes AC E2): the 3-token head "\\ufffd"
  (a cut E2) is not a prefix of the text "€\\ufffd", so nothing is emitted until "€€" completes."""
  ranks = [bytes([i]) for i in range(256)] + [b"\xac\xe2"]
  tok = tokenizer_from_bytes("\n".join(f"{base64.b64encode(t).decode()} {r}"
                                       for r, t in enumerate(ranks)).encode(), "x.tiktoken")
  det = IncrementalDetokenizer(tok)
  assert [det.add(i) for i in (0xE2, 0x82, 256, 0x82)] == ["", "", "", ""]
  assert det.add(0xAC) == "€€" and not det.has_pending


def test_stop_strings_completing_at_one_place_the_longest_wins():
  m = _StopMatcher(["ab", "abc", "zz"])
  assert m.push("xabcd") == ("x", "abc")
  m = _StopMatcher(["abc", "ab"])
  assert m.push("qabd") == ("q", "ab")
  m = _StopMatcher(["STOP", "END"])
  assert m.push("a END b STOP") == ("a ", "END")  # the earliest wins over a later one


def test_one_feed_or_close_merges_its_text_into_one_delta(tok):
  """An unclosed call at close becomes text twice over (the stop matcher's safe part, then what it
  held back): the client gets one TextDelta."""
  proc = OutputProcessor(tok, thinking=False, thinking_budget=None, tools=TOOLS, stop=["END"])
  deltas, reason = feed_all(proc, [sp(tok, "tool_call")] + tok.encode('{"a": "EN'))
  assert deltas == [] and reason is None
  assert proc.close("length") == [TextDelta('{"a": "EN')] and proc.stop_sequence is None


def test_call_with_an_extra_key_is_text(tok):
  payload = '{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": 3}'
  proc = OutputProcessor(tok, thinking=False, thinking_budget=None, tools=TOOLS)
  deltas, reason = feed_all(proc, [sp(tok, "tool_call")] + tok.encode(payload) + [sp(tok, "/tool_call")])
  assert proc.tool_calls == [] and proc.text == payload and deltas == [TextDelta(payload)]


def test_call_arguments_keep_non_ascii_text_raw(tok):
  payload = json.dumps({"name": "get_weather", "arguments": {"city": "Zürich €"}})  # \\u escapes
  proc = OutputProcessor(tok, thinking=False, thinking_budget=None, tools=TOOLS)
  feed_all(proc, [sp(tok, "tool_call")] + tok.encode(payload) + [sp(tok, "/tool_call")])
  assert [c.arguments for c in proc.tool_calls] == ['{"city": "Zürich €"}']


@pytest.mark.parametrize("end", ["end_of_turn", "eos"])
def test_the_turn_end_is_not_a_thinking_token(tok, end):
  proc = OutputProcessor(tok, thinking=True, thinking_budget=None)
  ids = tok.encode("abc")
  deltas, reason = feed_all(proc, ids + [sp(tok, end)])
  assert reason == "stop" and proc.thinking_tokens == len(ids) and proc.thinking_text == "abc"


def test_think_after_a_thinking_block_is_dropped(tok):
  """Thinking on: a second <|think|> right after <|/think|> does not reopen thinking."""
  proc = OutputProcessor(tok, thinking=True, thinking_budget=None)
  feed_all(proc, tok.encode("hm") + [sp(tok, "/think"), sp(tok, "think")] + tok.encode("ok"))
  assert proc.thinking_text == "hm" and proc.text == "ok" and proc.thinking_tokens == 2
  assert proc.next_constraint() is None


def test_free_run_in_thinking_is_what_is_left_of_the_budget(tok):
  ids = tok.encode("hmm, let me think")
  assert len(ids) >= 5
  proc = OutputProcessor(tok, thinking=True, thinking_budget=5)
  assert proc.free_run().max_tokens == 5
  feed_all(proc, ids[:2])
  assert proc.thinking_tokens == 2 and proc.free_run().max_tokens == 3
  feed_all(proc, ids[2:5])
  assert proc.free_run() is None and proc.next_constraint() == sp(tok, "/think")


def test_no_free_run_while_the_answer_is_constrained(tok):
  """response_format: every answer token is stepped through the grammar, never run freely."""
  proc = OutputProcessor(tok, thinking=True, thinking_budget=2, response_format=ResponseFormat())
  assert proc.free_run().max_tokens == 2
  feed_all(proc, [sp(tok, "/think")])
  assert proc.free_run() is None and proc.next_constraint() == tok.encode("{")[0]


def test_forced_call_cut_by_an_error_becomes_text(tok):
  """Only 'length' turns an unclosed forced call into a truncated call; other ends give text."""
  for reason in ("error", "cancelled"):
    proc = OutputProcessor(tok, thinking=False, thinking_budget=None, tools=TOOLS,
                           tool_choice=ToolChoice("required"))
    head = '{"name": "get_weather", "arguments": {"city": "Ro'
    feed_all(proc, [sp(tok, "tool_call")] + tok.encode(head))
    assert proc.close(reason) == [TextDelta(head)] and proc.tool_calls == []


def test_think_after_a_call_is_dropped(tok):
  """Thinking off: a <|think|> after the model's first tool call does not open thinking."""
  call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
  proc = OutputProcessor(tok, thinking=False, thinking_budget=3, tools=TOOLS)
  feed_all(proc, [sp(tok, "tool_call")] + tok.encode(call) + [sp(tok, "/tool_call"), sp(tok, "think")]
           + tok.encode("done"))
  assert len(proc.tool_calls) == 1 and proc.text == "done" and proc.thinking_tokens == 0


def test_text_held_back_before_a_call_is_delivered_before_it(tok):
  """A possible stop-string start ("E" of "END") is delivered when a call opens; the text after the
  call starts a fresh match, so "E" + call + "ND" is not a stop."""
  call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
  proc = OutputProcessor(tok, thinking=False, thinking_budget=None, tools=TOOLS, stop=["END"])
  ids = (tok.encode("Hi E") + [sp(tok, "tool_call")] + tok.encode(call) + [sp(tok, "/tool_call")]
         + tok.encode("ND") + [sp(tok, "end_of_turn")])
  deltas, reason = feed_all(proc, ids)
  segments = []  # text runs between calls
  for d in deltas:
    if isinstance(d, ToolCallDelta):
      segments.append(d.call.name)
    elif segments and segments[-1] != "get_weather":
      segments[-1] += d.text
    else:
      segments.append(d.text)
  assert segments == ["Hi E", "get_weather", "ND"]
  assert reason == "tool_calls" and proc.stop_sequence is None and proc.text == "Hi END"


def test_every_strict_call_under_auto_is_constrained(tok):
  """Two strict calls in one turn: the second starts its grammar afresh (reset), so it is
  constrained from its first token and parses too."""
  strict = Tool("n", "", {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]},
                strict=True)
  proc = OutputProcessor(tok, thinking=False, thinking_budget=None, tools=[strict])
  for k in (1, 22):
    proc.feed(sp(tok, "tool_call"))
    first = proc.next_constraint()
    assert first is not None and first != sp(tok, "/tool_call")
    for i in tok.encode('{"name": "n", "arguments": {"k": %d}}' % k):
      c = proc.next_constraint()
      assert c == i if isinstance(c, int) else c[i]
      proc.feed(i)
    assert proc.next_constraint() == sp(tok, "/tool_call")
    proc.feed(sp(tok, "/tool_call"))
  assert [json.loads(c.arguments) for c in proc.tool_calls] == [{"k": 1}, {"k": 22}]
