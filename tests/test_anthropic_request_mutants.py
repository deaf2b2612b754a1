"""Anthropic Messages request parsing (serving/anthropic_request.py, anthropic_schema.py) against
the documented API (https://docs.anthropic.com/en/api/messages): sampling bounds at their edges,
the defaults, tools and tool_choice, signed thinking, prefill and structured outputs. Each test
names the mistake it catches; all call parse_request directly (no server)."""

import types

import numpy as np
import pytest

from serving import signing
from serving.anthropic_request import InvalidRequest, parse_request
from serving.types import ResponseFormat, TextPart, ToolChoice

KEY = b"key"
SERVING = types.SimpleNamespace(thinking_budgets={"low": 37, "high": 211, "max": 977},
                                default_effort="none", max_tools=2, max_images=2)
USER = [{"role": "user", "content": "x"}]
TOOL = {"name": "f", "input_schema": {"type": "object"}}
BAD = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}  # llguidance refuses `not`


def _parse(messages=USER, **kw):
  return parse_request({"model": "m", "max_tokens": 64, "messages": messages, **kw}, serving=SERVING,
                       key=KEY, decode_image=lambda data: np.zeros((4, 4, 3), np.float32))


def _error(messages=USER, **kw) -> str:
  with pytest.raises(InvalidRequest) as e:
    _parse(messages, **kw)
  assert e.value.status == 400
  return e.value.message


def _tool_turns(assistant_blocks, result="r"):
  return [{"role": "user", "content": "a"}, {"role": "assistant", "content": assistant_blocks},
          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": result}]}]


USE = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}


# ---- sampling: the last accepted value and the first refused one ------------------------------
@pytest.mark.parametrize("field, ok, bad", [
    ("temperature", [0.0, 1.0], [1.01, -0.01]),  # Anthropic: 0 to 1
    ("top_p", [1e-9, 1.0], [0.0, 1.01]),
    ("top_k", [0, 1, 2**31 - 1], [-1, 2**31]),
])
def test_sampling_bounds(field, ok, bad):
  for v in ok:
    assert getattr(_parse(**{field: v}).params, field) == v
  for v in bad:
    assert _error(**{field: v}).startswith(f"{field}: ")


def test_sampling_values_reach_their_own_fields():
  params = _parse(temperature=0.25, top_p=0.5, top_k=7).params
  assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.25, 0.5, 7, 64)


def test_defaults():
  req = _parse()
  assert (req.stream, req.stop, req.prefill, req.thinking) == (False, [], False, False)
  assert req.response_format is None
  assert (req.params.temperature, req.params.top_p, req.params.top_k) == (1.0, 1.0, 0)
  enabled = _parse(thinking={"type": "enabled", "budget_tokens": 9})
  assert enabled.thinking_display == "summarized"
  assert _parse(tools=[TOOL]).tools[0].strict is False


def test_stop_sequence_limits():
  most = [f"s{i}" for i in range(16)]
  assert _parse(stop_sequences=most).stop == most
  assert _parse(stop_sequences=["x" * 256]).stop == ["x" * 256]


# ---- tools, tool_choice ----------------------------------------------------------------------
def test_tools_limit_strict_and_default_choice():
  req = _parse(tools=[TOOL, {**TOOL, "name": "g", "strict": True}])  # exactly max_tools = 2
  assert [(t.name, t.strict) for t in req.tools] == [("f", False), ("g", True)]
  assert req.tool_choice == ToolChoice("auto", None, True)  # no tool_choice with tools: auto
  assert _error(tools=[TOOL, {**TOOL, "name": "g"}, {**TOOL, "name": "h"}]).startswith("tools: at most 2")


def test_only_constrained_tools_must_compile():
  tools = [TOOL, {"name": "g", "input_schema": BAD}]
  _parse(tools=tools)  # auto: g is free-form
  _parse(tools=tools, tool_choice={"type": "tool", "name": "f"})
  assert _error(tools=tools, tool_choice={"type": "tool", "name": "g"}).startswith("tools.1.input_schema: ")
  assert _error(tools=tools, tool_choice={"type": "any"}).startswith("tools.1.input_schema: ")
  assert _error(tools=[{**tools[1], "strict": True}]).startswith("tools.0.input_schema: ")


def test_tool_use_ids_and_arguments():
  assert _error(_tool_turns([{**USE, "id": ""}])).startswith("messages.1.content.0.id: ")
  req = _parse(_tool_turns([{**USE, "input": {"k": "é☃"}}]))
  assert req.messages[1].tool_calls[0].arguments == '{"k": "é☃"}'  # as written, not \\u-escaped


# ---- thinking --------------------------------------------------------------------------------
def test_thinking_signatures():
  sealed = signing.seal_thinking(KEY, "secret")
  # display "omitted" returns empty text + the sealed thinking: unsealed only when the text is empty.
  omitted = _parse(_tool_turns([{"type": "thinking", "thinking": "", "signature": sealed}, USE]))
  assert omitted.messages[1].thinking == "secret"
  assert _error(_tool_turns([{"type": "thinking", "thinking": "other", "signature": sealed}, USE])) == \
      "messages.1.content.0: Invalid `signature` in `thinking` block"
  redacted = _parse(_tool_turns([{"type": "redacted_thinking", "data": sealed}, USE]))
  assert redacted.messages[1].thinking == "secret"
  assert _error(_tool_turns([{"type": "redacted_thinking", "data": "AAAA"}, USE])) == \
      "messages.1.content.0: Invalid `data` in `redacted_thinking` block"


def test_thinking_must_lead_the_last_tool_turn():
  sig = signing.sign_thinking(KEY, "h")
  on = {"thinking": {"type": "enabled", "budget_tokens": 9}}
  think = {"type": "thinking", "thinking": "h", "signature": sig}
  _parse(_tool_turns([think, USE]), **on)
  late = _tool_turns([{"type": "text", "text": "t"}, think, USE])
  assert "Expected `thinking` or `redacted_thinking`, but found `text`" in _error(late, **on)
  _parse(_tool_turns([{"type": "text", "text": "t"}, USE]))  # thinking off: no requirement


def test_budget_must_be_below_max_tokens():
  assert _parse(thinking={"type": "enabled", "budget_tokens": 63}).thinking_budget == 63  # max_tokens 64
  assert "must be greater than `thinking.budget_tokens`" in _error(thinking={"type": "enabled",
                                                                          "budget_tokens": 64})


def test_redacted_trigger_counts_in_user_turns_only():
  on = {"thinking": {"type": "enabled", "budget_tokens": 9}}
  trigger = signing.REDACTED_THINKING_TRIGGER
  said = [{"role": "user", "content": "a"}, {"role": "assistant", "content": trigger},
          {"role": "user", "content": "b"}]
  assert _parse(said, **on).thinking_display == "summarized"
  assert _parse([{"role": "user", "content": trigger}], **on).thinking_display == "redacted"


# ---- turns, prefill, structured outputs --------------------------------------------------------
def test_only_an_empty_final_assistant_message_is_dropped():
  dropped = _parse([{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}])
  assert [m.role for m in dropped.messages] == ["user"] and not dropped.prefill
  assert _error([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                 {"role": "user", "content": ""}]) == \
      "messages.2.content.0.text: text content blocks must be non-empty"


def test_prefill_and_output_format():
  fmt = {"format": {"type": "json_schema", "schema": {"type": "object"}}}
  fmt_out = _parse(output_config=fmt).response_format
  assert isinstance(fmt_out, ResponseFormat) and fmt_out.schema == {"type": "object"}
  prefill = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "{"}]
  assert _parse(prefill).messages[-1].content == [TextPart("{")]
  assert _error(prefill, output_config=fmt).startswith("output_config.format: structured outputs cannot")
  assert _error(output_config={"format": {"type": "json_schema", "schema": BAD}}).startswith(
      "output_config.format.schema: ")


@pytest.mark.parametrize("media_type", ["image/jpeg", "image/png", "image/gif", "image/webp"])
def test_image_media_types(media_type):
  image = {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": "AAAA"}}
  assert _parse([{"role": "user", "content": [image]}]).messages[0].content[0].pixels.shape == (4, 4, 3)
