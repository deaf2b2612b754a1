"""OpenAI request parsing (serving/openai_request.py) value by value, against the documented API
(https://platform.openai.com/docs/api-reference/chat/create): field bounds at their edges, the
defaults, the neutral values of unsupported fields, tools and response_format. Each test names
the mistake it catches; all call the parsers directly (no server)."""

import base64
import io
import types

import pydantic
import pytest
from PIL import Image

from serving.errors import APIError
from serving.openai_request import (
  ChatRequest,
  CompletionRequest,
  ImageDecoder,
  convert_messages,
  convert_tools,
  refuse_unsupported,
  response_format,
)
from serving.types import TextPart, ToolChoice

USER = [{"role": "user", "content": "x"}]
# A schema llguidance refuses ("not" is unimplemented): only a constrained tool must compile.
BAD = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}


def _chat(**kw):
  return ChatRequest.model_validate({"model": "m", "messages": USER, **kw})


def _refused_field(**kw) -> tuple:
  with pytest.raises(pydantic.ValidationError) as e:
    _chat(**kw)
  return e.value.errors()[0]["loc"]


# ---- field bounds: the last accepted value and the first refused one ---------------------------
@pytest.mark.parametrize("field, ok, bad", [
    ("temperature", [0.0, 2.0], [-0.01, 2.01]),  # OpenAI: 0 to 2
    ("top_p", [1e-9, 1.0], [0.0, 1.01]),  # (0, 1]: 0 would keep no token
    ("top_k", [0, 2**31 - 1], [-1, 2**31]),  # 0 = off; the engine's top_k is int32
    ("n", [1, 16], [0, 17]),  # MAX_N = 16
    ("max_tokens", [1], [0]),
    ("max_completion_tokens", [1], [0]),
])
def test_sampling_bounds(field, ok, bad):
  for v in ok:
    assert getattr(_chat(**{field: v}), field) == v
  for v in bad:
    assert _refused_field(**{field: v})[0] == field


def test_messages_must_not_be_empty():
  with pytest.raises(pydantic.ValidationError) as e:
    ChatRequest.model_validate({"model": "m", "messages": []})
  assert e.value.errors()[0]["loc"] == ("messages",)


@pytest.mark.parametrize("field, value", [
    ("stream", "yes"), ("max_tokens", "5"), ("max_tokens", 5.0), ("n", True), ("temperature", "1"),
    ("seed", 1.5)])
def test_types_are_not_coerced(field, value):
  assert _refused_field(**{field: value})[0] == field


def test_defaults_are_openais():
  body = _chat(stream_options={})
  assert (body.n, body.stream, body.stream_options.include_usage) == (1, False, False)
  assert (body.temperature, body.top_p, body.top_k, body.seed, body.max_tokens) == (None,) * 5
  assert body.continue_final_message is False
  completion = CompletionRequest.model_validate({"model": "m", "prompt": "p"})
  assert (completion.echo, completion.n, completion.stream) == (False, 1, False)


# ---- unsupported fields: their neutral values pass, any use is a 400 naming them -------------
@pytest.mark.parametrize("field, neutral, used", [
    ("logprobs", [False, None], [True]),
    ("top_logprobs", [0, None], [2]),
    ("logit_bias", [{}, None], [{"50256": -100}]),
    ("frequency_penalty", [0, 0.0, None], [0.5, -1]),
    ("presence_penalty", [0, 0.0, None], [1, -0.5]),
    ("functions", [None], [[], [{"name": "f"}]]),  # the field itself is the unsupported feature
    ("function_call", [None], ["auto", "none"]),
])
def test_unsupported_chat_fields(field, neutral, used):
  for v in neutral:
    refuse_unsupported(_chat(**{field: v}))
  for v in used:
    with pytest.raises(APIError) as e:
      refuse_unsupported(_chat(**{field: v}))
    assert e.value.status == 400 and e.value.param == field


def test_unsupported_completion_fields():
  def body(**kw):
    return CompletionRequest.model_validate({"model": "m", "prompt": "p", **kw})
  refuse_unsupported(body(suffix=""))  # an empty suffix inserts nothing
  refuse_unsupported(body(best_of=1))
  refuse_unsupported(body(n=4, best_of=4))
  for kw, param in [(dict(suffix="s"), "suffix"), (dict(n=2, best_of=3), "best_of"),
                    (dict(logprobs=1), "logprobs")]:
    with pytest.raises(APIError) as e:
      refuse_unsupported(body(**kw))
    assert e.value.param == param


def test_refused_combinations():
  """OpenAI's 400s: best_of below n (each choice is the best of best_of), stream_options without
  stream; a chat body's best_of (no such field) is refused unless it is a neutral 1."""
  comp = lambda **kw: CompletionRequest.model_validate({"model": "m", "prompt": "p", **kw})  # noqa: E731
  for body, message in [(comp(n=3, best_of=1), "at least n"), (comp(n=3, best_of=2), "at least n"),
                        (comp(stream_options={"include_usage": True}), "only allowed when stream"),
                        (_chat(stream=False, stream_options={}), "only allowed when stream"),
                        (_chat(best_of=2), "not supported"), (_chat(best_of="2"), "not supported")]:
    with pytest.raises(APIError, match=message) as e:
      refuse_unsupported(body)
    assert e.value.status == 400 and e.value.param in ("best_of", "stream_options")
  for body in [comp(n=3, best_of=3), comp(n=1, best_of=1), comp(stream=True, stream_options={}),
               _chat(best_of=1), _chat(stream=True, stream_options={"include_usage": True})]:
    refuse_unsupported(body)


def test_a_conversation_may_not_end_in_unanswered_tool_calls():
  call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
  msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
  with pytest.raises(APIError, match="ends with tool calls that no tool message answers \\(c1\\)") as e:
    convert_messages(_chat(messages=msgs).messages, ImageDecoder(None, 4))
  assert e.value.param == "messages[1]"
  answered = msgs + [{"role": "tool", "tool_call_id": "c1", "content": "r"}]
  assert [m.role for m in convert_messages(_chat(messages=answered).messages, ImageDecoder(None, 4))] == \
    ["user", "assistant", "tool"]


# ---- tools -----------------------------------------------------------------------------------
def _fn(name, parameters=None, **kw):
  return {"type": "function", "function": {"name": name, **({} if parameters is None else
                                                               {"parameters": parameters}), **kw}}


def _tool_error(**kw) -> APIError:
  with pytest.raises(APIError) as e:
    convert_tools(_chat(**kw), 4)
  assert e.value.status == 400
  return e.value


def test_tool_names():
  tools, _ = convert_tools(_chat(tools=[_fn("a" * 64), _fn("A-9_z")]), 4)
  assert [t.name for t in tools] == ["a" * 64, "A-9_z"]
  for name in ("a" * 65, "a.b", "fé", "", "f\n", "f g"):
    assert _tool_error(tools=[_fn(name)]).param == "tools[0].function.name", name
  assert _tool_error(tools=[_fn("f"), _fn("g"), _fn("f")]).param == "tools[2].function.name"


def test_tool_fields_and_defaults():
  tools, choice = convert_tools(_chat(tools=[_fn("f", description="d", strict=True), _fn("g")]), 4)
  assert (tools[0].strict, tools[0].description) == (True, "d")
  assert (tools[1].strict, tools[1].description) == (False, "")
  assert tools[1].parameters == {"type": "object", "properties": {}}  # no parameters: no arguments
  assert choice == ToolChoice("auto", None, True)  # parallel_tool_calls unset = true, as on OpenAI
  _, choice = convert_tools(_chat(tools=[_fn("f")], parallel_tool_calls=None), 4)
  assert choice.parallel


@pytest.mark.parametrize("parameters", [{"type": "array", "items": {"type": "string"}}, {"type": "string"},
                                        {"type": ["object", "null"]}])
def test_parameters_must_be_an_object_schema(parameters):
  """A call's arguments are one JSON object: an array or string schema was accepted and rendered into
  the prompt, though no call could follow it (OpenAI answers 400; the Anthropic side already did)."""
  e = _tool_error(tools=[_fn("f", parameters)])
  assert e.param == "tools[0].function.parameters" and "must be a JSON Schema of type 'object'" in e.message
  convert_tools(_chat(tools=[_fn("f", {"properties": {"a": {"type": "string"}}})]), 4)  # type left out


def test_only_constrained_tools_must_compile():
  """strict tools, and the tools tool_choice required / named forces, are compiled; others not."""
  convert_tools(_chat(tools=[_fn("f"), _fn("g", BAD)]), 4)  # auto: g is free-form
  convert_tools(_chat(tools=[_fn("f"), _fn("g", BAD)], tool_choice={"type": "function",
                                                                      "function": {"name": "f"}}), 4)
  assert _tool_error(tools=[_fn("f"), _fn("g", BAD)], tool_choice="required").param == \
      "tools[1].function.parameters"
  assert _tool_error(tools=[_fn("f"), _fn("g", BAD)], tool_choice={
      "type": "function", "function": {"name": "g"}}).param == "tools[1].function.parameters"
  assert _tool_error(tools=[_fn("g", BAD, strict=True)]).param == "tools[0].function.parameters"
  convert_tools(_chat(tools=[_fn("g", BAD)], tool_choice="none"), 4)


# ---- response_format -------------------------------------------------------------------------
def _schema_format(**spec):
  return _chat(response_format={"type": "json_schema", "json_schema": {"name": "out", **spec}})


def test_response_format_json_schema():
  assert response_format(_chat()) is None
  assert response_format(_chat(response_format={"type": "text"})) is None
  schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
  assert response_format(_schema_format(schema=schema, strict=False)).schema == schema
  assert response_format(_schema_format(schema={})).schema == {}  # {} is any value, not "no schema"
  assert response_format(_schema_format()).schema is None  # no schema: any object


@pytest.mark.parametrize("fmt, param", [
    ({"type": "json"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a b"}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a\n"}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": BAD}},
     "response_format.json_schema.schema"),
])
def test_response_format_errors(fmt, param):
  with pytest.raises(APIError) as e:
    response_format(_chat(response_format=fmt))
  assert e.value.status == 400 and e.value.param == param


# ---- messages --------------------------------------------------------------------------------
def _convert(messages, decode=None):
  return convert_messages(_chat(messages=messages).messages, decode or ImageDecoder(None, 4))


def test_message_contents():
  out = _convert([{"role": "system", "content": "S"}, {"role": "user", "content": ""},
                  {"role": "assistant", "content": "", "reasoning_content": "RC", "reasoning": "R"},
                  {"role": "user", "content": [{"type": "text", "text": "a"},
                                               {"type": "text", "text": "b"}]}])
  assert [m.role for m in out] == ["system", "user", "assistant", "user"]
  assert out[1].content == [] and out[2].content == []  # an empty string is no part
  assert out[2].thinking == "RC"  # reasoning_content wins over reasoning
  assert out[3].content == [TextPart("a"), TextPart("b")]


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text"),
    ([{"role": "system", "content": [{"type": "text", "text": None}]}], "messages[0].content[0].text"),
    ([*USER, {"role": "assistant", "content": [{"type": "refusal"}]}], "messages[1].content[0].refusal"),
    ([{"role": "user", "content": [{"type": "input_audio"}]}], "messages[0].content[0].type"),
    ([*USER, {"role": "tool", "content": "r"}], "messages[1].tool_call_id"),
])
def test_message_errors_name_the_part(messages, param):
  """A text part without its string names `.text` (it used to say that type 'text' was unsupported)."""
  with pytest.raises(APIError) as e:
    _convert(messages)
  assert e.value.status == 400 and e.value.param == param


def test_images_without_a_vision_encoder():
  """The limit counts images, the n-th one past it is refused; a disabled encoder is no encoder."""
  image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
  for vision in (None, types.SimpleNamespace(enabled=False, image_size=4, num_channels=3)):
    with pytest.raises(APIError, match="no vision encoder") as e:
      _convert([{"role": "user", "content": [image]}], ImageDecoder(vision, 1))  # 1 image: at the limit
    assert e.value.param == "messages[0].content[0]"
  buf = io.BytesIO()
  Image.new("RGB", (2, 2), (255, 0, 0)).save(buf, format="PNG")
  url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
  png = {"type": "image_url", "image_url": {"url": url}}
  vision = types.SimpleNamespace(enabled=True, image_size=4, num_channels=3)
  out = _convert([{"role": "user", "content": [{"type": "text", "text": "t"}, png]}], ImageDecoder(vision, 1))
  assert out[0].content[1].pixels.shape == (4, 4, 3)
  with pytest.raises(APIError, match="more than 1 images") as e:
    _convert([{"role": "user", "content": [png, png]}], ImageDecoder(vision, 1))
  assert e.value.param == "messages[0].content[1]"
