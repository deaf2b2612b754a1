"""serving/anthropic_schema.py's request models against Anthropic's API reference
(https://docs.anthropic.com/en/api/messages): tool names at their pattern's edges, custom tools
only, the defaults of tool_result.is_error and of the adaptive thinking display, and the image
source types that get the no-network message. Each test names the mistake it catches; no server."""

import types

import numpy as np
import pytest

from serving.anthropic_request import InvalidRequest, parse_request

SERVING = types.SimpleNamespace(thinking_budgets={"low": 37, "high": 211, "max": 977},
                                default_effort="none", max_tools=4, max_images=2)
USER = [{"role": "user", "content": "x"}]


def _parse(messages=USER, **kw):
  return parse_request({"model": "m", "max_tokens": 64, "messages": messages, **kw}, serving=SERVING,
                       key=b"key", decode_image=lambda data: np.zeros((4, 4, 3), np.float32))


def _error(messages=USER, **kw) -> str:
  with pytest.raises(InvalidRequest) as e:
    _parse(messages, **kw)
  assert e.value.status == 400
  return e.value.message


def _tool(name, **kw):
  return {"name": name, "input_schema": {"type": "object"}, **kw}


def test_tool_names_follow_the_pattern_up_to_128_characters():
  names = ["a" * 128, "A-b_9", "x"]
  assert [t.name for t in _parse(tools=[_tool(n) for n in names]).tools] == names
  for bad in ("a" * 129, "f.g", "f g", "", "é"):
    assert _error(tools=[_tool(bad)]).startswith("tools.0.name: String should match pattern"), bad


def test_only_custom_tools_are_taken():
  assert [t.name for t in _parse(tools=[_tool("f", type="custom")]).tools] == ["f"]
  for kind in ("function", "bash_20250124"):
    assert _error(tools=[_tool("f", type=kind)]) == (
        f"tools.0.type: server tool '{kind}' is not supported by this server; only custom tools "
        "(name, description, input_schema) are")


def test_tool_result_is_error_defaults_to_false():
  turns = [{"role": "user", "content": "a"},
           {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]}]
  tool = _parse(turns).messages[2]
  assert tool.role == "tool" and [p.text for p in tool.content] == ["r"]
  turns[2]["content"][0]["is_error"] = True
  assert [p.text for p in _parse(turns).messages[2].content] == ["Error: r"]


def test_thinking_display_defaults_to_summarized():
  assert _parse(thinking={"type": "adaptive"}).thinking_display == "summarized"
  assert _parse(thinking={"type": "enabled", "budget_tokens": 9}).thinking_display == "summarized"
  omitted = _parse(thinking={"type": "adaptive", "display": "omitted"})
  assert omitted.thinking_display == "omitted"


@pytest.mark.parametrize("kind", ["url", "file"])
def test_url_and_file_images_are_refused_for_having_no_network(kind):
  image = {"type": "image", "source": {"type": kind, "media_type": "image/png", "data": "AAAA"}}
  message = _error([{"role": "user", "content": [image]}])
  assert message.startswith(f"messages.0.content.0.source.type: image source type '{kind}' is not supported: "
                            "this server has no network or Files API access.")
