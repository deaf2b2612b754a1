"""serving.constrained / serving.grammar edge cases that mutation testing found unchecked.

Each test pins one behaviour a small source change (a mutant) altered without any other test
failing: refs in a single tool's schema, the read-only masks, error fields, the answer
constraint after its document starts, which tools' schemas a request compiles, strict mode
on objects that only say `properties` or `patternProperties`, and validate_arguments' output.
Expected values are written out by hand.
"""

import numpy as np
import pytest

from serving.constrained import AnswerConstraint, ToolCallConstraint, build_constraints
from serving.grammar import JsonMatcher, compile_schema, validate_arguments
from serving.types import ResponseFormat, Tool, ToolChoice
from tests.test_grammar import accepts
from training.tokenizer import default_tokenizer_path, load_tokenizer

REFS = {"type": "object", "$defs": {"t": {"type": "integer", "minimum": 3, "maximum": 7}},
        "properties": {"v": {"$ref": "#/$defs/t"}}, "required": ["v"]}


@pytest.fixture(scope="module")
def tok():
  return load_tokenizer(default_tokenizer_path("tiny"))


def feed(tok, c, text) -> bool:
  """Advances `c` through the canonical tokens of `text`; False at the first refused one."""
  for i in tok.encode(text):
    try:
      c.advance(i)
    except ValueError:
      return False
  return True




def test_single_tool_refs_resolve_in_the_call(tok):
  """One tool (no anyOf wrapper): its "#/$defs/..." refs point into the call's arguments."""
  for choice in (ToolChoice("required"), ToolChoice("named", "r")):
    c = ToolCallConstraint(tok, [Tool("r", "", REFS)], choice)
    c.advance(tok.special_id("tool_call"))
    assert feed(tok, c, '{"name": "r", "arguments": {"v": 5}}')
    assert c.next() == tok.special_id("/tool_call")
  bad = ToolCallConstraint(tok, [Tool("r", "", REFS)], ToolChoice("required"))
  bad.advance(tok.special_id("tool_call"))
  assert not feed(tok, bad, '{"name": "r", "arguments": {"v": 9}}')  # $defs/t's maximum is 7


def test_masks_are_read_only(tok):
  """next() hands out read-only masks (the documented contract): a consumer cannot write into one."""
  tool = Tool("f", "", {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})
  call = ToolCallConstraint(tok, [tool], ToolChoice("required"))
  call.advance(tok.special_id("tool_call"))
  feed(tok, call, '{"name": "f", "arguments": {"x": ')
  grammar = compile_schema(tok, {"type": "object"}, "response_format", closed=False)
  answer = AnswerConstraint(tok, grammar, calls_allowed=True)
  for mask in (call.next(), answer.next()):
    assert isinstance(mask, np.ndarray) and mask.sum() > 1 and not mask.flags.writeable


def test_named_tool_schema_error_names_its_index(tok):
  tools = [Tool("a"), Tool("b"), Tool("c", "", {"type": "string"})]
  with pytest.raises(ValueError, match=r"^tools\[2\]\.parameters must be an object schema"):
    ToolCallConstraint(tok, tools, ToolChoice("named", "c"))


def test_answer_constraint_after_the_document_starts(tok):
  """Once the document's first token is in, neither a call nor the end of the turn may come."""
  grammar = compile_schema(tok, {"type": "object"}, "response_format", closed=False)
  open_, end = tok.special_id("tool_call"), tok.special_id("end_of_turn")
  a = AnswerConstraint(tok, grammar, calls_allowed=True)
  assert a.next(called=True)[open_] and a.next(called=True)[end]  # before it: both allowed
  a.advance(tok.encode("{")[0])
  mask = a.next(called=True)
  assert not mask[open_] and not mask[end]
  with pytest.raises(ValueError):
    a.advance(open_)
  assert a.text == "{"
  assert feed(tok, a, "}") and a.next(called=True) == end


def test_constraints_built_per_tool_choice(tok):
  strict = Tool("s", "", {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
                strict=True)
  loose = Tool("l", "", {"type": "string"})  # not an object schema, but not strict: args are any object
  built = build_constraints(tok, [strict, loose], ToolChoice("auto"), None)
  assert built.forced is None and built.answer is None
  assert feed(tok, built.calls, '{"name": "l", "arguments": {"any": [1]}}')
  built.calls.reset()
  assert not feed(tok, built.calls, '{"name": "s", "arguments": {"n": "x"}}')
  none = build_constraints(tok, [strict], ToolChoice("none"), None)
  assert none.forced is None and none.calls is None and none.answer is None  # no call can open
  named = build_constraints(tok, [strict], ToolChoice("named", "s"), ResponseFormat())
  assert named.forced.next() == tok.special_id("tool_call") and named.answer is None


def test_non_local_refs_are_not_rewritten(tok):
  """Only local refs ("#/...") move with the tool's schema: a ref to an `$id` keeps working, and a
  remote one is refused by name."""
  params = {"type": "object", "$defs": {"t": {"$id": "urn:t", "type": "integer"}},
            "properties": {"v": {"$ref": "urn:t"}}, "required": ["v"]}
  good = ToolCallConstraint(tok, [Tool("a", "", params)], ToolChoice("required"))
  good.advance(tok.special_id("tool_call"))
  assert feed(tok, good, '{"name": "a", "arguments": {"v": 5}}')
  assert good.next() == tok.special_id("/tool_call")
  bad = ToolCallConstraint(tok, [Tool("a", "", params)], ToolChoice("required"))
  bad.advance(tok.special_id("tool_call"))
  assert not feed(tok, bad, '{"name": "a", "arguments": {"v": "x"}}')  # urn:t is an integer
  remote = {"type": "object", "properties": {"v": {"$ref": "https://example.com/v.json"}}}
  with pytest.raises(ValueError, match=r"tools\[0\]\.parameters.*https://example\.com/v\.json"):
    ToolCallConstraint(tok, [Tool("a", "", remote)], ToolChoice("required"))


def test_strict_mode_closes_objects_that_only_say_properties(tok):
  schema = {"type": "object", "properties": {"p": {"properties": {"a": {"type": "integer"}}}},
            "required": ["p"]}
  assert accepts(tok, schema, '{"p": {"a": 1}}')
  assert not accepts(tok, schema, '{"p": {"a": 1, "b": 2}}')
  assert accepts(tok, schema, '{"p": {"a": 1, "b": 2}}', closed=False)


def test_strict_mode_leaves_pattern_properties_open(tok):
  """patternProperties objects are not closed: other keys stay allowed (additionalProperties unset)."""
  schema = {"type": "object", "patternProperties": {"^x": {"type": "integer"}}}
  assert accepts(tok, schema, '{"x1": 1, "y": "z"}')
  assert not accepts(tok, schema, '{"x1": "no"}')


def test_allows_refuses_ids_outside_the_vocabulary(tok):
  m = JsonMatcher(compile_schema(tok, {"type": "object"}, "s", closed=False))
  assert m.allows(tok.encode("{")[0])
  assert not m.allows(tok.vocab_size) and not m.allows(-1)


def test_validate_arguments_boolean_schemas_and_error_order():
  assert validate_arguments(True, {"a": 1}) == []
  assert validate_arguments(False, {"a": 1}) == ["$: the schema `false` accepts nothing"]
  schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
  assert validate_arguments(schema, {"b": "x", "a": 2}) == [
      "$.a: 2 is not of type 'string'", "$.b: 'x' is not of type 'integer'"]  # sorted by path
