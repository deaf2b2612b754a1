"""serving.grammar (llguidance JSON-schema grammars) and the structured-output constraints.

Schema features the old hand-written automaton did not have (pattern, minimum/maximum,
anyOf/oneOf, $ref/$defs, format) are checked by accepting and refusing texts, and by
random drives over the allowed tokens whose output `jsonschema` (an independent
implementation) must accept. The OutputProcessor tests play the engine: forced ids are fed,
masks sampled from, as serving/batch.py applies them.
"""

import json

import jsonschema
import numpy as np
import pytest

from serving.constrained import AnswerConstraint, CallConstraint, tool_call_schema
from serving.grammar import JsonMatcher, SchemaError, check_schema, close_objects, compile_schema
from serving.output import OutputProcessor
from serving.types import ResponseFormat, TextDelta, Tool, ToolCallDelta
from tests.helpers import drive_processor
from training.tokenizer import default_tokenizer_path, load_tokenizer

POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                          "y": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
         "required": ["x", "y"]}
FEATURES = {
    "$defs": {"point": POINT},
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[a-z]{2}-[0-9]{3}$"},
        "kind": {"enum": ["a", "b", 3, None]},
        "where": {"$ref": "#/$defs/point"},
        "path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 3},
        "grid": {"type": "array", "maxItems": 2,
                 "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                           "maxItems": 3}},
        "label": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]},
        "size": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 10},
                           {"type": "string", "enum": ["big", "small"]}]},
        "when": {"type": "string", "format": "date"},
    },
    "required": ["id", "kind", "where", "path"],
}
TREE = {"$defs": {"node": {"type": "object", "properties": {
    "v": {"type": "integer", "minimum": 0, "maximum": 99},
    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, "required": ["v"]}},
    "$ref": "#/$defs/node"}
GOOD = {"id": "ab-123", "kind": None, "where": {"x": -5, "y": 0.5}, "path": [{"x": 5, "y": 1}],
        "grid": [[0, 9], []], "label": None, "size": "big", "when": "2026-12-03"}


@pytest.fixture(scope="module")
def toks():
  return {v: load_tokenizer(default_tokenizer_path(v)) for v in ("tiny", "small")}


def sp(tok, name):
  return tok.special_id(name)


def accepts(tok, schema, text, closed=True) -> bool:
  """Whether the canonical tokenization of `text` is a complete document under `schema`."""
  m = JsonMatcher(compile_schema(tok, schema, "s", closed=closed))
  try:
    for i in tok.encode(text):
      m.consume(i)
  except ValueError:
    return False
  return m.accepting


def dumps(value) -> str:
  return json.dumps(value, separators=(", ", ": "))


@pytest.mark.parametrize("change", [
    {}, {"label": "abcdef"}, {"size": 10}, {"size": 0}, {"kind": 3}, {"kind": "b"},
    {"path": [{"x": 0, "y": 0.001}] * 3},
])
def test_features_accept_valid_documents(toks, change):
  doc = {**GOOD, **change}
  jsonschema.validate(doc, FEATURES)  # the case itself is valid
  for tok in toks.values():
    assert accepts(tok, FEATURES, dumps(doc)), doc


@pytest.mark.parametrize("change", [
    {"id": "AB-123"}, {"id": "ab-12"},  # pattern
    {"where": {"x": 6, "y": 0.5}}, {"where": {"x": -6, "y": 0.5}},  # minimum / maximum via $ref
    {"where": {"x": 0, "y": 0}}, {"where": {"x": 0, "y": 1.5}},  # exclusiveMinimum / maximum
    {"where": {"x": 0}},  # required inside the $ref
    {"path": []}, {"path": [{"x": 0, "y": 1}] * 4},  # minItems / maxItems
    {"grid": [[10]]}, {"grid": [[1, 2, 3, 4]]}, {"grid": [[], [], []]},  # nested arrays
    {"label": 5}, {"label": "abcdefg"},  # anyOf
    {"size": 11}, {"size": "huge"}, {"size": None},  # oneOf
    {"kind": "c"}, {"kind": 4},  # enum
    {"when": "2026-13-45"}, {"when": "yesterday"},  # format
    {"extra": 1},  # closed object
])
def test_features_refuse_invalid_documents(toks, change):
  doc = {**GOOD, **change}
  with pytest.raises(jsonschema.ValidationError):
    jsonschema.validate(doc, close_objects(FEATURES), format_checker=jsonschema.FormatChecker())  # invalid
  for tok in toks.values():
    assert not accepts(tok, FEATURES, dumps(doc)), doc


def test_optional_properties_may_be_left_out_but_keep_order(toks):
  tok = toks["small"]
  minimal = {k: GOOD[k] for k in ("id", "kind", "where", "path")}
  assert accepts(tok, FEATURES, dumps(minimal))
  assert accepts(tok, FEATURES, dumps({**minimal, "size": 1}))
  assert not accepts(tok, FEATURES, dumps({"kind": "a", **{k: v for k, v in minimal.items() if k != "kind"}}))
  assert not accepts(tok, FEATURES, dumps({k: v for k, v in minimal.items() if k != "where"}))


def test_recursive_ref(toks):
  tok = toks["tiny"]
  assert accepts(tok, TREE, dumps({"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}, {"v": 4}]}))
  assert not accepts(tok, TREE, dumps({"v": 1, "kids": [{"v": 2, "kids": [{"v": 300}]}]}))
  assert not accepts(tok, TREE, dumps({"v": 1, "kids": [{"v": 2}, {"v": 3}, {"v": 4}]}))


def test_closed_is_strict_mode_and_json_object_is_open(toks):
  tok = toks["tiny"]
  schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}
  assert close_objects(schema)["additionalProperties"] is False
  assert accepts(tok, schema, '{"a": 1, "b": [true]}')  # a required name without a schema: any value
  assert not accepts(tok, schema, '{"a": 1, "b": 1, "c": 1}')
  assert accepts(tok, schema, '{"a": 1, "b": 1, "c": 1}', closed=False)
  assert accepts(tok, {"type": "object", "additionalProperties": True}, '{"q": {"r": [1, "s"]}}')


def random_document(tok, matcher, rng, bound=20000) -> str:
  """Random allowed tokens until only <|end_of_turn|> is allowed; the text."""
  end = sp(tok, "end_of_turn")
  for _ in range(bound):
    mask = matcher.mask()
    assert mask.any()
    choices = np.flatnonzero(mask)
    if matcher.complete:
      assert choices.tolist() == [end]
      return matcher.text
    if mask[end]:  # accepting yet extensible (a number at the end): end here half the time
      assert matcher.accepting
      if rng.random() < 0.5:
        return matcher.text
    choices = choices[choices != end]
    matcher.consume(int(rng.choice(choices)))
  raise AssertionError("the document did not end")


@pytest.mark.parametrize("variant,schema,runs", [
    ("tiny", FEATURES, 30), ("small", FEATURES, 10), ("tiny", TREE, 20), ("small", {"type": "integer"}, 10)])
def test_random_weights_drives_validate(toks, variant, schema, runs):
  """Uniform sampling over the mask (a random-weights model) always yields a valid document."""
  tok = toks[variant]
  rng = np.random.default_rng(11)
  grammar = compile_schema(tok, schema, "s")
  for _ in range(runs):
    text = random_document(tok, JsonMatcher(grammar), rng)
    jsonschema.validate(json.loads(text), close_objects(schema), format_checker=jsonschema.FormatChecker())


def test_multi_tool_wrapper_rebases_refs(toks):
  """Two tools with their own $defs of one name: each call's $ref resolves within its own tool."""
  tok = toks["small"]
  a = Tool("a", "", {"type": "object", "$defs": {"t": {"type": "integer"}},
                     "properties": {"v": {"$ref": "#/$defs/t"}}, "required": ["v"]})
  b = Tool("b", "", {"type": "object", "$defs": {"t": {"type": "string", "maxLength": 2}},
                     "properties": {"v": {"$ref": "#/$defs/t"}}, "required": ["v"]})
  schema = tool_call_schema([(a, True), (b, True)])
  ok = ['{"name": "a", "arguments": {"v": 7}}', '{"name": "b", "arguments": {"v": "xy"}}']
  bad = ['{"name": "a", "arguments": {"v": "xy"}}', '{"name": "b", "arguments": {"v": 7}}']
  assert all(accepts(tok, schema, t) for t in ok) and not any(accepts(tok, schema, t) for t in bad)
  free = tool_call_schema([(a, True), (b, False)])  # b not constrained: any object
  assert accepts(tok, free, '{"name": "b", "arguments": {"anything": [1]}}')
  assert not accepts(tok, free, '{"name": "a", "arguments": {"anything": [1]}}')


def test_schema_errors_name_the_field():
  for schema, why in (({"type": "strng"}, "strng"), ({"type": "array", "uniqueItems": True}, "uniqueItems"),
                      ([1], "must be an object"), ({"pattern": "(("}, "regex"),
                      ({"type": "object", "properties": {"s": {"$ref": "#/nope"}}}, "nope")):
    with pytest.raises(SchemaError, match=why) as e:
      check_schema(schema, "response_format.json_schema.schema")
    assert e.value.field == "response_format.json_schema.schema"
    assert str(e.value).startswith("response_format.json_schema.schema: ")


def test_call_constraint_forces_the_closing_marker(toks):
  tok = toks["tiny"]
  tool = Tool("f", "", {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})
  c = CallConstraint(tok, compile_schema(tok, tool_call_schema([(tool, True)]), "tools"))
  for i in tok.encode('{"name": "f", "arguments": {"x": 12}}'):
    assert c.next() is not None
    c.advance(i)
  assert c.next() == sp(tok, "/tool_call") and not c.done
  with pytest.raises(ValueError):
    c.advance(sp(tok, "end_of_turn"))
  c.advance(sp(tok, "/tool_call"))
  assert c.done and c.next() is None
  c.reset()
  assert not c.done and c.text == ""


def test_answer_constraint_start_and_end(toks):
  tok = toks["tiny"]
  grammar = compile_schema(tok, {"type": "object"}, "response_format", closed=False)
  a = AnswerConstraint(tok, grammar, calls_allowed=True)
  first = a.next()
  assert first[sp(tok, "tool_call")] and not first[sp(tok, "end_of_turn")]
  assert a.next(called=True)[sp(tok, "end_of_turn")]  # after a call the turn may end without a document
  no_calls = AnswerConstraint(tok, grammar, calls_allowed=False)
  assert no_calls.next() == tok.encode("{")[0]  # the object's brace is the only way to start
  with pytest.raises(ValueError):
    no_calls.advance(sp(tok, "tool_call"))
  for i in tok.encode('{"a": 1}'):
    no_calls.advance(i)
  assert no_calls.next() == sp(tok, "end_of_turn")  # complete: only the end of the turn


def _drive(proc, rng, free_ids, max_steps=3000):
  """tests.helpers.drive_processor, stopping on the end of turn as the engine does."""
  return drive_processor(proc, rng, free_ids, max_steps, stop_id=proc._id["end_of_turn"])


@pytest.mark.parametrize("thinking", [False, True])
def test_response_format_json_schema(toks, thinking):
  tok = toks["tiny"]
  rng = np.random.default_rng(5)
  for _ in range(6):
    proc = OutputProcessor(tok, thinking=thinking, thinking_budget=3, response_format=ResponseFormat(TREE))
    deltas, reason = _drive(proc, rng, tok.encode("let me think"))
    assert reason == "stop"
    text = "".join(d.text for d in deltas if isinstance(d, TextDelta))
    assert text == proc.text
    jsonschema.validate(json.loads(text), close_objects(TREE))
    assert proc.thinking_tokens == (3 if thinking else 0)


def test_response_format_json_object_and_tool_calls(toks):
  """json_object: any object; under tool_choice auto a call may open before the document."""
  tok = toks["tiny"]
  rng = np.random.default_rng(2)
  tools = [Tool("f", "", {"type": "object", "properties": {"x": {"type": "integer"}}})]
  proc = OutputProcessor(tok, thinking=False, thinking_budget=None, tools=tools,
                         response_format=ResponseFormat())
  mask = proc.next_constraint()
  assert mask[sp(tok, "tool_call")] and not mask[sp(tok, "think")] and not mask[sp(tok, "end_of_turn")]
  for i in [sp(tok, "tool_call"), *tok.encode('{"name": "f", "arguments": {}}'), sp(tok, "/tool_call")]:
    proc.feed(i)  # f is not strict: the call is free
  assert len(proc.tool_calls) == 1
  assert proc.next_constraint()[sp(tok, "end_of_turn")]  # the turn may end after the call
  deltas, reason = _drive(OutputProcessor(tok, thinking=False, thinking_budget=None,
                                          response_format=ResponseFormat()), rng, [])
  assert reason == "stop"
  assert isinstance(json.loads("".join(d.text for d in deltas if isinstance(d, TextDelta))), dict)


def test_strict_tool_calls_under_auto(toks):
  """A strict tool's arguments follow its schema when the model opens a call itself."""
  tok = toks["tiny"]
  rng = np.random.default_rng(4)
  params = {"type": "object", "required": ["a", "b"], "properties": {
      "a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"enum": ["x", "y"]}}}
  strict = Tool("add", "", params, strict=True)
  loose = Tool("note", "", {"type": "object", "properties": {"t": {"type": "string"}}})
  for _ in range(8):
    proc = OutputProcessor(tok, thinking=False, thinking_budget=None, tools=[strict, loose])
    assert proc.next_constraint() is None  # free text until a call opens
    proc.feed(tok.encode("hi")[0])
    proc.feed(sp(tok, "tool_call"))
    c = proc.next_constraint()  # the call's JSON is constrained from its first token
    close = sp(tok, "/tool_call")
    assert c is not None and not (c == close if isinstance(c, int) else c[close])
    deltas, _ = _drive(proc, rng, [sp(tok, "end_of_turn")])
    calls = [d.call for d in deltas if isinstance(d, ToolCallDelta)]
    assert len(calls) == 1
    if calls[0].name == "add":
      jsonschema.validate(json.loads(calls[0].arguments), close_objects(strict.parameters))
    else:
      assert isinstance(json.loads(calls[0].arguments), dict)
  free = OutputProcessor(tok, thinking=False, thinking_budget=None, tools=[loose])
  free.feed(sp(tok, "tool_call"))
  assert free.next_constraint() is None  # no strict tool: calls stay free


def test_tiktoken_tokenizers_bridge():
  """A tiktoken rank file (the other format training.tokenizer loads) gets the same grammars."""
  import base64

  from training.tokenizer import tokenizer_from_bytes

  ranks = [bytes([i]) for i in range(256)] + [b'{"', b'":', b"na", b"me"]
  tok = tokenizer_from_bytes("\n".join(f"{base64.b64encode(t).decode()} {r}"
                                       for r, t in enumerate(ranks)).encode(), "x.tiktoken")
  assert tok.kind == "tiktoken"
  assert accepts(tok, TREE, '{"v": 1, "kids": [{"v": 2}]}') and not accepts(tok, TREE, '{"v": 100}')
  assert random_document(tok, JsonMatcher(compile_schema(tok, TREE, "s")), np.random.default_rng(0))
