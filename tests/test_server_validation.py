"""Request validation shared by both APIs: the Anthropic pydantic models and the error messages.

serving/anthropic_schema.py validates the Messages API body with pydantic;
these cases pin the messages that the hand-written parser it replaced gave
(strict types, null = absent, content-block union tags left out of the path,
custom messages naming the field), so agent middleware keeps reading them.
serving/errors.py formats the first pydantic error in each vendor's words.
"""

import pytest

from serving import images
from serving.anthropic_request import InvalidRequest, parse_request
from serving.errors import loc_to_param, validation_message

USER = [{"role": "user", "content": "x"}]
TOOL = {"name": "f", "input_schema": {"type": "object"}}


def _parse(serve_config, body, **kw):
  return parse_request(body, serving=serve_config.serving, key=b"key",
                       decode_image=lambda data: images.decode_image(data, 4), **kw)


def _body(messages=USER, **kw):
  return {"model": "m", "max_tokens": 32, "messages": messages, **kw}


@pytest.mark.parametrize("body, message", [
    ({"model": "m", "max_tokens": True, "messages": USER}, "max_tokens: Input should be a valid integer"),
    ({"model": None, "max_tokens": 3, "messages": USER}, "model: Field required"),
    ({"model": "m", "max_tokens": 0, "messages": USER},
     "max_tokens: Input should be greater than or equal to 1"),
    (_body([]), "messages: List should have at least 1 item after validation, not 0"),
    (_body([3]), "messages.0: Input should be a valid dictionary"),
    (_body([{"role": "user", "content": 5}]),
     "messages.0.content: Input should be a valid string or a list of content blocks"),
    (_body([{"role": "user", "content": [{"type": "text"}]}]), "messages.0.content.0.text: Field required"),
    (_body([{"role": "user", "content": [5]}]),
     "messages.0.content.0: Input should be a content block object with a `type`"),
    (_body([{"role": "user", "content": [{"type": "video"}]}]),
     "messages.0.content.0.type: content blocks of type 'video' are not supported by this server"),
    (_body([{"role": "user", "content": [{"type": "text", "text": ""}]}]),
     "messages.0.content.0.text: text content blocks must be non-empty"),
    (_body([{"role": "user", "content": [{"type": "image", "source": {"type": "b64"}}]}]),
     "messages.0.content.0.source.type: Input should be 'base64'"),
    (_body([{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "a b", "name": "f", "input": {}}]}, {"role": "user", "content": "y"}]),
     "messages.1.content.0.id: String should match pattern '^[a-zA-Z0-9_-]+$'"),
    (_body(system=[{"type": "text", "text": ""}]), "system.0.text: text content blocks must be non-empty"),
    (_body(tools=[TOOL, TOOL]), "tools: Tool names must be unique."),
    (_body(tools=[{"name": "f", "input_schema": {"type": "array"}}]),
     "tools.0.input_schema.type: Input should be 'object'"),
    (_body(tool_choice={"type": "tool"}, tools=[TOOL]), "tool_choice.name: Field required"),
    (_body(tool_choice={"type": "sometimes"}),
     "tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'"),
    (_body(thinking={"type": "enabled"}), "thinking.enabled.budget_tokens: Field required"),
    (_body(thinking={"type": "enabled", "budget_tokens": 0}),
     "thinking.enabled.budget_tokens: Input should be greater than or equal to 1"),
    (_body(thinking={"type": "maybe"}), "thinking.type: Input should be 'enabled', 'disabled' or 'adaptive'"),
    (_body(thinking={"type": "between_tools"}), "thinking.type: 'between_tools' is not supported"),
    (_body(thinking={"type": "adaptive", "display": "hidden"}),
     "thinking.display: Input should be 'summarized' or 'omitted'"),
    (_body(output_config={"effort": "none"}),
     "output_config.effort: Input should be 'low', 'medium', 'high', 'xhigh' or 'max'"),
    (_body(temperature=2), "temperature: Input should be between 0 and 1"),
    (_body(temperature=True), "temperature: Input should be a valid number"),
    (_body(top_p=0), "top_p: Input should be greater than 0 and at most 1"),
    (_body(top_k=-1), "top_k: Input should be greater than or equal to 0"),
    (_body(stop_sequences=["a", " "]),
     "stop_sequences.1: each stop sequence must be a string with non-whitespace characters"),
    (_body(stream=1), "stream: Input should be a valid boolean"),
    (_body(metadata=[]), "metadata: Input should be a valid dictionary"),
    ([1], "the request body must be a JSON object"),
])
def test_anthropic_error_messages(serve_config, body, message):
  with pytest.raises(InvalidRequest) as e:
    _parse(serve_config, body)
  assert e.value.message.startswith(message), e.value.message
  assert e.value.status == 400


def test_anthropic_nulls_defaults_and_count_tokens(serve_config):
  req = _parse(serve_config, _body(system=None, tools=None, temperature=None, stream=None, metadata=None))
  assert req.params.temperature == 1.0 and req.params.top_p == 1.0 and req.params.top_k == 0
  assert not req.stream and req.tools == [] and [m.role for m in req.messages] == ["user"]
  assert req.params.max_tokens == 32 and isinstance(req.params.temperature, float)
  # count_tokens takes no max_tokens (an invalid one is not read) and no sampling.
  counted = _parse(serve_config, {"model": "m", "max_tokens": "many", "messages": USER}, count_only=True)
  assert counted.messages[0].content[0].text == "x"
  # A string system prompt is one text block; an empty one is no system message.
  assert _parse(serve_config, _body(system="S")).messages[0].content[0].text == "S"
  assert [m.role for m in _parse(serve_config, _body(system="")).messages] == ["user"]


def test_error_locations_in_each_vendors_style():
  loc = ("body", "messages", 0, "content", 1, "block[text]", "text")
  assert loc_to_param(loc, anthropic=False) == "messages[0].content[1].text"
  assert loc_to_param(loc, anthropic=True) == "messages.0.content.1.text"
  assert loc_to_param(("body", "stop", "str"), anthropic=False) == "stop"
  # A union member's model class is pydantic's, not the client's: it is not part of the field.
  loc = ("body", "tool_choice", "NamedToolChoice", "type")
  assert loc_to_param(loc, anthropic=False) == "tool_choice.type"
  assert loc_to_param(("body",), anthropic=False) is None
  errors = [{"type": "missing", "loc": ("body", "messages"), "msg": "Field required"},
            {"type": "missing", "loc": ("body", "model"), "msg": "Field required"}]
  assert validation_message(errors, anthropic=False) == ("messages: Field required (and 1 more errors)",
                                                          "messages")
  assert validation_message(errors, anthropic=True) == ("messages: Field required", "messages")
  not_object = [{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be an object"}]
  assert "must be a JSON object" in validation_message(not_object, anthropic=False)[0]
  bad_json = [{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error"}]
  assert validation_message(bad_json, anthropic=False)[0].startswith("The request body is not valid JSON")
