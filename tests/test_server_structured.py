"""Structured outputs through both APIs (serving/constrained.py on llguidance): OpenAI's
response_format and strict/forced tool arguments, Anthropic's output_config.format and strict tools.

Same session server as tests/test_server_openai.py and tests/test_server_anthropic.py (random `tiny`
model), so the tests check that what comes back follows the schema, and that a bad schema or an
unsupported combination is a 400 naming the field.
"""

import json

import anthropic
import openai
import pytest

from serving.anthropic_request import InvalidRequest
from tests.test_server_anthropic import TOOLS, _body, _parse
from tests.test_server_openai import KEY, MODEL, TOOL, _assemble, _error, _user


@pytest.fixture(scope="module")
def oai(server_url):
  return openai.OpenAI(base_url=server_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ant(server_url):
  return anthropic.Anthropic(base_url=server_url, api_key=KEY, max_retries=0, timeout=120)


# ---- OpenAI: response_format, strict and forced tool arguments ----------------------------
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["c", "n", "ok"], "properties": {
    "c": {"type": "string", "pattern": "^[a-z]{1,3}$"}, "n": {"type": "integer", "minimum": 1, "maximum": 9},
    "ok": {"type": "boolean"}}}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}


def test_response_format_json_schema(oai):
  import jsonschema

  kw = dict(model=MODEL, messages=_user("Answer in JSON."), response_format=JSON_SCHEMA,
            max_completion_tokens=60, temperature=1.0)
  for seed in range(3):
    r = oai.chat.completions.create(seed=seed, **kw)
    (choice,) = r.choices
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
  content, _, calls, finish, _, _ = _assemble(oai.chat.completions.create(seed=2, stream=True, **kw))
  assert (content, calls, finish) == (r.choices[0].message.content, {}, "stop")
  text = oai.chat.completions.create(model=MODEL, messages=_user("Answer in JSON."), seed=2,
                                     max_completion_tokens=12, response_format={"type": "text"})
  assert text.choices[0].message.content != r.choices[0].message.content  # text: unconstrained


def test_response_format_json_object(oai):
  for seed in range(3):
    r = oai.chat.completions.create(model=MODEL, messages=_user("JSON please."), seed=seed,
                                    response_format={"type": "json_object"}, max_completion_tokens=120)
    content, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert content.startswith("{")
    if finish == "stop":
      assert isinstance(json.loads(content), dict)
    else:  # cut by max_completion_tokens: a prefix of an object
      assert finish == "length"


def test_strict_and_forced_tool_arguments_follow_the_schema(oai):
  import jsonschema

  params = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 12}},
            "required": ["n"]}  # short: the tool's schema is part of the tiny (256-token) prompt
  strict = {"type": "function", "function": {"name": "g", "strict": True, "parameters": params}}
  for seed in range(3):
    r = oai.chat.completions.create(model=MODEL, messages=_user("Call g."), tools=[strict], seed=seed,
                                    tool_choice="required", max_completion_tokens=56, reasoning_effort="none")
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "g" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), {**params, "additionalProperties": False})


# a schema the server rejects (uniqueItems), in both APIs
BAD = {"type": "object", "properties": {"s": {"type": "array", "uniqueItems": True}}}


@pytest.mark.parametrize("kw, param", [
    (dict(response_format={"type": "xml"}), "response_format.type"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
     "response_format.json_schema.name"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": BAD}}),
     "response_format.json_schema.schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "strng"}}}),
     "response_format.json_schema.schema"),
    (dict(tools=[{"type": "function", "function": {"name": "g", "strict": True, "parameters": BAD}}]),
     "tools[0].function.parameters"),
    (dict(tools=[TOOL, {"type": "function", "function": {"name": "g", "parameters": BAD}}],
          tool_choice={"type": "function", "function": {"name": "g"}}), "tools[1].function.parameters"),
    (dict(messages=_user("x") + [{"role": "assistant", "content": "{"}], response_format=JSON_SCHEMA,
          extra_body={"continue_final_message": True}), "response_format"),
])
def test_structured_output_errors_name_the_field(oai, kw, param):
  kw = {"messages": _user("x"), **kw}
  with pytest.raises(openai.BadRequestError) as e:
    oai.chat.completions.create(model=MODEL, max_completion_tokens=4, **kw)
  err = _error(e)
  assert e.value.status_code == 400 and err["param"] == param, err
  assert err["message"].startswith(param) or param in err["message"]


# ---- Anthropic: tools[].strict, output_config.format --------------------------------------
FORMAT_SCHEMA = {"type": "object", "properties": {"c": {"type": "string", "pattern": "^[a-z]{1,3}$"},
                                                  "n": {"type": "integer", "minimum": 1, "maximum": 9}},
                 "required": ["c", "n"]}


def test_parse_structured_outputs(serve_config):
  user = [{"role": "user", "content": "x"}]
  strict = [{**TOOLS[0], "strict": True}]
  req = _parse(serve_config, _body(user, tools=strict, output_config={"format": {
      "type": "json_schema", "schema": FORMAT_SCHEMA}}))
  assert req.tools[0].strict and req.response_format.schema == FORMAT_SCHEMA
  plain = _parse(serve_config, _body(user, tools=TOOLS))
  assert not plain.tools[0].strict and plain.response_format is None


@pytest.mark.parametrize("kw, needle", [
    (dict(tools=[{**TOOLS[0], "input_schema": BAD, "strict": True}]), "tools.0.input_schema: "),
    (dict(tools=[{**TOOLS[0], "input_schema": BAD}], tool_choice={"type": "any"}),
     "tools.0.input_schema: "),
    (dict(output_config={"format": {"type": "json_schema", "schema": BAD}}),
     "output_config.format.schema: "),
    (dict(output_config={"format": {"type": "json_schema", "schema": {"type": "strng"}}}),
     "output_config.format.schema: "),
    (dict(output_config={"format": {"type": "xml"}}), "output_config.format.type"),
    (dict(output_config={"format": {"type": "json_schema"}}), "output_config.format.schema"),
])
def test_parse_structured_output_errors(serve_config, kw, needle):
  with pytest.raises(InvalidRequest) as e:
    _parse(serve_config, _body([{"role": "user", "content": "x"}], **kw))
  assert e.value.message.startswith(needle) and e.value.status == 400, e.value.message
  prefill = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "{"}]
  with pytest.raises(InvalidRequest, match="output_config.format"):
    _parse(serve_config, _body(prefill, output_config={"format": {"type": "json_schema",
                                                                  "schema": FORMAT_SCHEMA}}))


def test_output_config_format_constrains_the_text(ant):
  import jsonschema

  for temperature in (0, 1):
    resp = ant.messages.create(
        model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "JSON"}],
        extra_body={"temperature": temperature, "thinking": {"type": "disabled"},
                    "output_config": {"format": {"type": "json_schema", "schema": FORMAT_SCHEMA}}})
    assert [b.type for b in resp.content] == ["text"] and resp.stop_reason == "end_turn"
    jsonschema.validate(json.loads(resp.content[0].text), {**FORMAT_SCHEMA, "additionalProperties": False})


def test_strict_tool_input_follows_the_schema(ant):
  import jsonschema

  schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 12}},
            "required": ["n"]}
  tool = {"name": "g", "input_schema": schema, "strict": True}
  for temperature in (0, 1):
    resp = ant.messages.create(
        model=MODEL, max_tokens=56, messages=[{"role": "user", "content": "Call g."}], tools=[tool],
        tool_choice={"type": "any"},
        extra_body={"temperature": temperature, "thinking": {"type": "disabled"}})
    (call,) = [b for b in resp.content if b.type == "tool_use"]
    assert call.name == "g" and resp.stop_reason == "tool_use"
    jsonschema.validate(call.input, {**schema, "additionalProperties": False})
