"""Requests as strict as the real APIs (issue 15 §4): types, model names, forced tool calls cut short.

Every field of the four request schemas (OpenAI chat and completions,
Anthropic messages and count_tokens) gets values of every JSON type: a value
of a wrong type must be a 400 naming the field in its API's shape, and a
value that is accepted must keep its JSON type (nothing coerced: "yes" is no
boolean, true no integer, 5.0 no integer, "5" no number). The session server
(tests/conftest.py) answers.
"""

import json

import httpx
import pydantic
import pytest

from serving.anthropic_api import partial_object
from serving.anthropic_schema import CountTokensRequest, MessagesRequest
from serving.openai_request import ChatRequest, CompletionRequest

KEY = "test-key"
MODEL = "horizon-tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "x"}]
TOOL_OPENAI = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
TOOL_ANTHROPIC = {"name": "f", "input_schema": TOOL_OPENAI["function"]["parameters"]}

# One value of each JSON type (5.0: an int-valued float, refused where an integer is due).
VALUES = [True, 5, 5.0, 2.5, "yes", "5", [1], [], {"a": 1}, {}]
SCHEMAS = [  # (schema, route, a valid body, fields with no wrong type)
    (ChatRequest, "/v1/chat/completions", {"model": MODEL, "messages": USER}, set()),
    (CompletionRequest, "/v1/completions", {"model": MODEL, "prompt": "x"}, set()),
    (MessagesRequest, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": USER}, set()),
    # count_tokens takes no max_tokens: any value is ignored, as on Anthropic.
    (CountTokensRequest, "/v1/messages/count_tokens", {"model": MODEL, "messages": USER}, {"max_tokens"}),
]


def _kept_type(given, got) -> bool:
  """The validated value has the JSON type that was sent (an object may become a model)."""
  if isinstance(given, bool):
    return got is given
  if isinstance(given, int):
    return type(got) in (int, float) and got == given
  if isinstance(given, str):  # Anthropic: a string `system` is one text block (its documented shorthand)
    return isinstance(got, str) or (isinstance(got, list) and got[0].text == given)
  if isinstance(given, float):
    return type(got) is float
  if isinstance(given, list):
    return isinstance(got, list)
  return isinstance(got, (dict, pydantic.BaseModel))


@pytest.mark.parametrize("schema, route, base, exempt", SCHEMAS, ids=[s[1] for s in SCHEMAS])
def test_every_field_refuses_wrong_types_naming_it(server_url, schema, route, base, exempt):
  anthropic = route.startswith("/v1/messages")
  refused_fields = set()
  with httpx.Client(base_url=server_url, headers=AUTH, timeout=60) as client:
    for field in schema.model_fields:
      for value in VALUES:
        body = {**base, field: value}
        try:
          validated = schema.model_validate(body)
        except pydantic.ValidationError:
          pass
        else:
          assert _kept_type(value, getattr(validated, field)), (field, value, getattr(validated, field))
          continue
        refused_fields.add(field)
        r = client.post(route, json=body)
        assert r.status_code == 400, (field, value, r.text)
        error = r.json()["error"]
        if anthropic:
          assert r.json()["type"] == "error" and error["type"] == "invalid_request_error"
          assert error["message"].startswith(field), (field, value, error)
        else:
          assert set(error) == {"message", "type", "param", "code"}
          assert error["param"].startswith(field), (field, value, error)
          assert error["message"].startswith(field), (field, value, error)
  assert refused_fields == set(schema.model_fields) - exempt


@pytest.mark.parametrize("field, value", [("stream", "yes"), ("max_tokens", "5"), ("max_tokens", 5.0),
                                          ("n", True), ("temperature", "0.5"), ("seed", 1.0)])
def test_openai_types_are_not_coerced(server_url, field, value):
  r = httpx.post(server_url + "/v1/chat/completions", headers=AUTH,
                 json={"model": MODEL, "messages": USER, field: value})
  assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_anthropic_unknown_and_missing_model(server_url):
  for path in ("/v1/messages", "/v1/messages/count_tokens"):
    unknown = httpx.post(server_url + path, headers=AUTH,
                         json={"model": "claude-x", "max_tokens": 4, "messages": USER})
    body = unknown.json()
    assert unknown.status_code == 404 and body["type"] == "error"
    assert body["error"]["type"] == "not_found_error" and "'horizon-tiny'" in body["error"]["message"]
    missing = httpx.post(server_url + path, headers=AUTH, json={"max_tokens": 4, "messages": USER})
    assert missing.status_code == 400 and missing.json()["error"]["message"] == "model: Field required"


def _openai_forced(server_url, choice, stream=False):
  body = {"model": MODEL, "messages": [{"role": "user", "content": "Call f."}], "tools": [TOOL_OPENAI],
          "tool_choice": choice, "max_tokens": 14, "temperature": 1.0, "seed": 3, "stream": stream}
  return httpx.post(server_url + "/v1/chat/completions", headers=AUTH, json=body, timeout=120)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_openai_forced_call_cut_by_max_tokens(server_url, choice):
  r = _openai_forced(server_url, choice)
  (c,) = r.json()["choices"]
  assert r.status_code == 200 and c["finish_reason"] == "length", r.text
  (call,) = c["message"]["tool_calls"]
  assert call["function"]["name"] in ("f", "") and call["id"].startswith("call_")
  assert c["message"]["content"] is None
  if isinstance(choice, dict):
    assert call["function"]["name"] == "f"
  # Streaming: the same truncated call as tool_calls deltas, then finish_reason 'length'.
  lines = [ln for ln in _openai_forced(server_url, choice, stream=True).text.splitlines()
           if ln.startswith("data: {")]
  chunks = [json.loads(ln[6:]) for ln in lines]
  args = "".join(tc["function"].get("arguments") or "" for ch in chunks for tc in
                 ch["choices"][0]["delta"].get("tool_calls") or [])
  assert args == call["function"]["arguments"]
  assert chunks[-1]["choices"][0]["finish_reason"] == "length"
  assert not any(ch["choices"][0]["delta"].get("content") for ch in chunks)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "f"}])
def test_anthropic_forced_call_cut_by_max_tokens(server_url, choice):
  body = {"model": MODEL, "max_tokens": 14, "temperature": 1.0, "tools": [TOOL_ANTHROPIC],
          "tool_choice": choice, "messages": [{"role": "user", "content": "Call f."}]}
  r = httpx.post(server_url + "/v1/messages", headers=AUTH, json=body, timeout=120)
  msg = r.json()
  assert r.status_code == 200 and msg["stop_reason"] == "max_tokens", msg
  (block,) = msg["content"]
  assert block["type"] == "tool_use" and block["id"].startswith("toolu_") and isinstance(block["input"], dict)
  if choice["type"] == "tool":
    assert block["name"] == "f"
  stream = httpx.post(server_url + "/v1/messages", headers=AUTH, json={**body, "stream": True}, timeout=120)
  text = stream.text
  assert '"type":"tool_use"' in text and '"stop_reason":"max_tokens"' in text and "text_delta" not in text


@pytest.mark.parametrize("text, whole", [
    ("", {}), ("{", {}), ('{"a": 1', {"a": 1}), ('{"a": 1, "b": "x', {"a": 1}), ('{"a": 1, "b":', {"a": 1}),
    ('{"a": {"c": [1, 2', {"a": {"c": [1, 2]}}), ('{"a": "q\\"x", "b": tr', {"a": 'q"x'}),
    ('{"a": "}], ", "b": 2}', {"a": "}], ", "b": 2})])
def test_partial_object_keeps_the_whole_members(text, whole):
  """A truncated tool_use block's `input`: what of the cut JSON is whole (the SDK's partial parse)."""
  assert partial_object(text) == whole
