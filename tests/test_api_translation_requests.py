"""Request translation of both API front-ends, value by value (written against the vendors' docs and
serving_spec.md's effort table); each assertion pins a mutant the older tests let through."""

import types

import numpy as np
import pytest

from serving import prepare, signing
from serving.anthropic_request import InvalidRequest, parse_request
from serving.api_common import effort_thinking, generation_failure, resolve_tool_choice
from serving.errors import APIError
from serving.openai_request import (
  ChatRequest,
  CompletionRequest,
  ImageDecoder,
  convert_messages,
  convert_tools,
  refuse_unsupported,
  response_format,
  stop_strings,
)
from serving.types import ImagePart, Message, ResponseFormat, TextPart, Tool, ToolCall, ToolChoice

BUDGETS = {"low": 37, "high": 211, "max": 977}
SERVING = types.SimpleNamespace(thinking_budgets=BUDGETS, default_effort="none", max_tools=3, max_images=1)
TOOL = Tool(name="f", description="", parameters={"type": "object"})
RNG = np.random.default_rng(7)


# ---- effort, tool_choice, failures (serving/api_common.py) ---------------------
@pytest.mark.parametrize("effort, on, budget, tier", [
    ("none", False, None, None), ("minimal", False, None, None), ("low", True, 37, "low"),
    ("medium", True, 211, "high"), ("high", True, 211, "high"), ("xhigh", True, 977, "max"),
    ("max", True, 977, "max")])
def test_effort_tiers(effort, on, budget, tier):
  s = effort_thinking(effort, SERVING)
  assert (s.on, s.budget, s.effort) == (on, budget, tier)


def test_effort_default_comes_from_the_config():
  s = effort_thinking(None, types.SimpleNamespace(thinking_budgets=BUDGETS, default_effort="low"))
  assert (s.on, s.budget, s.effort) == (True, 37, "low")
  with pytest.raises(APIError, match="default_effort='huge'"):
    effort_thinking(None, types.SimpleNamespace(thinking_budgets=BUDGETS, default_effort="huge"))


def test_resolve_tool_choice():
  assert resolve_tool_choice(None, [TOOL]) == ToolChoice("auto", None, True)
  assert resolve_tool_choice("auto", []) == ToolChoice("none")
  assert resolve_tool_choice(None, []) == ToolChoice("none")
  assert resolve_tool_choice("auto", [TOOL], parallel=False) == ToolChoice("auto", None, False)
  assert resolve_tool_choice("none", [TOOL]) == ToolChoice("none")
  assert resolve_tool_choice("named", [TOOL], "f") == ToolChoice("named", "f")
  with pytest.raises(ValueError, match="at least one tool"):
    resolve_tool_choice("required", [])
  with pytest.raises(ValueError, match="'g'"):
    resolve_tool_choice("named", [TOOL], "g")


@pytest.mark.parametrize("reason, status", [("stop", None), ("length", None), ("tool_calls", None),
                                            ("cancelled", 503), ("error", 500), (None, 500)])
def test_generation_failure(reason, status):
  error = generation_failure(reason)
  assert (error.status if error else None) == status


# ---- prompt-size bound (serving/prepare.py) ------------------------------------
def _ctx(max_context=10):
  return types.SimpleNamespace(limits=types.SimpleNamespace(max_context=max_context, max_images=2),
                               max_token_bytes=4, renderer=types.SimpleNamespace(num_image_tokens=3))


def _image():
  return ImagePart(RNG.random((4, 4, 3), dtype=np.float32))


def test_refuse_too_long_at_the_exact_boundary():
  prepare.refuse_too_long(_ctx(), 36, 0, "messages")  # ceil(36 / 4) = 9 < 10: one token of room
  with pytest.raises(APIError, match="at least 10 tokens"):
    prepare.refuse_too_long(_ctx(), 37, 0, "messages")  # ceil(37 / 4) = 10: no room left
  with pytest.raises(APIError, match="at least 10 tokens"):
    prepare.refuse_too_long(_ctx(), 33, 1, "prompt")  # 9 + 1


@pytest.mark.parametrize("message, fits", [
    (Message("user", [TextPart("u" * 24), _image()]), True),  # 6 + 3 image tokens = 9
    (Message("user", [TextPart("u" * 24), _image(), _image()]), False),  # 6 + 6 = 12
    (Message("assistant", [], tool_calls=[ToolCall("c", "abcd", "x" * 32)]), True),  # 36 chars: 9
    (Message("assistant", [], tool_calls=[ToolCall("c", "abcde", "x" * 32)]), False),  # 37 chars: 10
    (Message("assistant", [TextPart("a")], thinking="t" * 36), False)])  # 37 chars
def test_check_prompt_size_counts_every_part(message, fits):
  if fits:
    prepare.check_prompt_size(_ctx(), [message], [])
  else:
    with pytest.raises(APIError, match="context_length_exceeded|at least"):
      prepare.check_prompt_size(_ctx(), [message], [])


def test_check_images_allows_exactly_the_limit():
  prepare.check_images(_ctx(), 2, "messages")
  with pytest.raises(APIError, match="3 images"):
    prepare.check_images(_ctx(), 3, "messages")


# ---- OpenAI (serving/openai_request.py) ----------------------------------------
def _chat(**kw):
  return ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}], **kw})


def test_stop_strings():
  assert stop_strings("##") == ["##"]
  assert stop_strings(None) == []
  assert stop_strings(["a", "b", "c", "d"]) == ["a", "b", "c", "d"]  # OpenAI: up to 4
  with pytest.raises(APIError, match="at most 4"):
    stop_strings(["a", "b", "c", "d", "e"])
  with pytest.raises(APIError, match="non-empty"):
    stop_strings(["a", ""])


def _fn(name):
  return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def test_openai_tools_limit_and_parallel_tool_calls():
  tools, choice = convert_tools(_chat(tools=[_fn("a"), _fn("b"), _fn("c")]), 3)  # exactly max_tools
  assert [t.name for t in tools] == ["a", "b", "c"] and choice == ToolChoice("auto", None, True)
  _, choice = convert_tools(_chat(tools=[_fn("a")], parallel_tool_calls=True), 3)
  assert choice.parallel
  _, choice = convert_tools(_chat(tools=[_fn("a")], parallel_tool_calls=False), 3)
  assert not choice.parallel
  with pytest.raises(APIError, match="at most 3"):
    convert_tools(_chat(tools=[_fn("a"), _fn("b"), _fn("c"), _fn("d")]), 3)


def test_openai_messages_roles_and_reasoning():
  msgs = _chat(messages=[
      {"role": "developer", "content": "D"},
      {"role": "user", "content": "U"},
      {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}], "reasoning": "R",
       "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                      {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "c2", "content": "two"},
      {"role": "tool", "tool_call_id": "c1", "content": "one"},
      {"role": "user", "content": "go"}]).messages
  out = convert_messages(msgs, ImageDecoder(None, 0))
  assert [m.role for m in out] == ["system", "user", "assistant", "tool", "tool", "user"]
  assert out[2].thinking == "R" and out[2].content == [TextPart("no")]
  assert [(m.tool_call_id, m.content[0].text) for m in out[3:5]] == [("c2", "two"), ("c1", "one")]


def test_openai_refusal_parts_only_in_assistant_messages():
  msgs = _chat(messages=[{"role": "system", "content": [{"type": "refusal", "refusal": "no"}]},
                         {"role": "user", "content": "x"}]).messages
  with pytest.raises(APIError, match=r"messages\[0\]\.content\[0\]"):
    convert_messages(msgs, ImageDecoder(None, 0))


def test_openai_neutral_values_are_not_refused():
  refuse_unsupported(CompletionRequest.model_validate({"model": "m", "prompt": "p", "n": 3, "best_of": 3}))
  refuse_unsupported(CompletionRequest.model_validate({"model": "m", "prompt": "p", "logprobs": 0}))
  with pytest.raises(APIError, match="best_of"):
    refuse_unsupported(CompletionRequest.model_validate({"model": "m", "prompt": "p", "n": 2, "best_of": 3}))
  with pytest.raises(APIError, match="logprobs"):
    refuse_unsupported(CompletionRequest.model_validate({"model": "m", "prompt": "p", "logprobs": 2}))


def test_openai_response_format_json_object_is_constrained():
  fmt = response_format(_chat(response_format={"type": "json_object"}))
  assert isinstance(fmt, ResponseFormat) and fmt.schema is None  # any JSON object
  assert response_format(_chat(response_format={"type": "text"})) is None


# ---- Anthropic (serving/anthropic_request.py) ----------------------------------
def _parse(messages, serving=SERVING, **kw):
  body = {"model": "m", "max_tokens": 500, "messages": messages, **kw}
  return parse_request(body, serving=serving, key=b"key", decode_image=lambda d: RNG.random((4, 4, 3)))


USER = [{"role": "user", "content": "x"}]
A_TOOL = {"name": "f", "input_schema": {"type": "object"}}


def _tool_turns(result_blocks):
  return [{"role": "user", "content": "a"},
          {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
          {"role": "user", "content": result_blocks}]


def test_anthropic_tool_result_text_blocks_are_joined():
  req = _parse(_tool_turns([{"type": "tool_result", "tool_use_id": "toolu_1",
                             "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]}]))
  assert req.messages[2].role == "tool" and req.messages[2].content == [TextPart("r1\n\nr2")]


def test_anthropic_tool_result_must_come_first():
  with pytest.raises(InvalidRequest, match="messages.2.content.1: tool_result blocks must come first"):
    _parse(_tool_turns([{"type": "text", "text": "t"},
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "r"}]))


def test_anthropic_thinking_blocks_of_a_turn_are_joined():
  sig1, sig2 = signing.sign_thinking(b"key", "h1"), signing.sign_thinking(b"key", "h2")
  req = _parse([{"role": "user", "content": "a"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "h1", "signature": sig1},
                                                  {"type": "thinking", "thinking": "h2", "signature": sig2},
                                                  {"type": "text", "text": "t"}]},
                {"role": "user", "content": "b"}])
  assert req.messages[1].thinking == "h1\n\nh2"


def test_anthropic_only_the_final_assistant_message_may_be_empty():
  with pytest.raises(InvalidRequest, match="messages.1: all messages must have non-empty content"):
    _parse([{"role": "user", "content": "a"}, {"role": "assistant", "content": []},
            {"role": "user", "content": "b"}])


def test_anthropic_prefill_rules():
  req = _parse([{"role": "user", "content": "a"}, {"role": "assistant", "content": "  lead"}])
  assert req.prefill and req.messages[-1].content == [TextPart("  lead")]  # leading space is fine
  with pytest.raises(InvalidRequest, match="trailing whitespace"):
    _parse([{"role": "user", "content": "a"}, {"role": "assistant", "content": "end "}])
  with pytest.raises(InvalidRequest, match="prefill.*cannot be used with `thinking`"):
    _parse([{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}],
           thinking={"type": "enabled", "budget_tokens": 9})


def test_anthropic_disable_parallel_tool_use():
  req = _parse(USER, tools=[A_TOOL], tool_choice={"type": "auto", "disable_parallel_tool_use": True})
  assert req.tool_choice == ToolChoice("auto", None, False)
  req = _parse(USER, tools=[A_TOOL], tool_choice={"type": "auto"})
  assert req.tool_choice == ToolChoice("auto", None, True)


@pytest.mark.parametrize("budget, tier", [(9, "low"), (37, "low"), (38, "high"), (211, "high"),
                                          (212, "max"), (400, "max")])
def test_anthropic_budget_tier_is_the_smallest_covering_one(budget, tier):
  req = _parse(USER, thinking={"type": "enabled", "budget_tokens": budget})
  assert (req.thinking, req.thinking_budget, req.effort) == (True, budget, tier)


def test_anthropic_effort_with_explicit_budget_and_adaptive_default():
  req = _parse(USER, thinking={"type": "enabled", "budget_tokens": 9}, output_config={"effort": "max"})
  assert (req.thinking_budget, req.effort) == (9, "max")
  req = _parse(USER, thinking={"type": "adaptive"})
  assert (req.thinking, req.thinking_budget, req.effort) == (True, 211, "high")


def test_anthropic_effort_alone_does_not_turn_thinking_on_when_the_default_is_off():
  req = _parse(USER, output_config={"effort": "high"})
  assert (req.thinking, req.thinking_budget, req.effort) == (False, None, None)
  on = types.SimpleNamespace(**{**vars(SERVING), "default_effort": "low"})
  req = _parse(USER, serving=on, output_config={"effort": "max"})
  assert (req.thinking, req.thinking_budget, req.effort) == (True, 977, "max")


def test_anthropic_redacted_trigger_only_matters_with_thinking_on():
  msgs = [{"role": "user", "content": signing.REDACTED_THINKING_TRIGGER}]
  assert _parse(msgs).thinking_display == "summarized"
  assert _parse(msgs, thinking={"type": "enabled", "budget_tokens": 9}).thinking_display == "redacted"


def test_anthropic_image_count_may_reach_the_limit():
  image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
  req = _parse([{"role": "user", "content": [image, {"type": "text", "text": "x"}]}])  # max_images = 1
  assert isinstance(req.messages[0].content[0], ImagePart)
  with pytest.raises(InvalidRequest, match="too many images: 2 > 1"):
    _parse([{"role": "user", "content": [image, image]}])
