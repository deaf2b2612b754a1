"""serving/grammar.py's strict mode where earlier audits did not look: objects under
additionalProperties, patternProperties and oneOf are closed too, `allOf` branches describe one
object together (JSON Schema: the instance must satisfy every branch), and `\\uXXXX` escapes
are in the language. References are the JSON Schema rules, written out document by document."""

import pytest

from serving.grammar import JsonMatcher, close_objects, compile_schema
from tests.test_grammar import accepts
from training.tokenizer import default_tokenizer_path, load_tokenizer


@pytest.fixture(scope="module")
def tok():
  return load_tokenizer(default_tokenizer_path("tiny"))


A = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
B = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}


@pytest.mark.parametrize("schema, ok, extra", [
    ({"type": "object", "additionalProperties": A}, '{"k": {"a": 1}}', '{"k": {"a": 1, "z": 2}}'),
    ({"type": "object", "patternProperties": {"^k": A}}, '{"k1": {"a": 1}}', '{"k1": {"a": 1, "z": 2}}'),
    ({"oneOf": [A, {"type": "null"}]}, '{"a": 1}', '{"a": 1, "z": 2}'),
])
def test_objects_under_every_subschema_keyword_are_closed(tok, schema, ok, extra):
  assert accepts(tok, schema, ok)
  assert not accepts(tok, schema, extra)
  assert accepts(tok, schema, extra, closed=False)  # open, the extra member is fine


@pytest.mark.parametrize("text", ['"\\u00e9"', '"\\u0041"', '"\\ud83d\\ude00"', '"\\u0001"'])
def test_unicode_escapes_are_strings(tok, text):
  """json.dumps writes non-ASCII as \\uXXXX: such text must stay in a string's language."""
  assert accepts(tok, {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]},
                 '{"s": ' + text + "}")


@pytest.mark.parametrize("schema", [
    {"allOf": [A, B]}, {"type": "object", "allOf": [A, B]}, {"allOf": [A, {"allOf": [B]}]},
    {"allOf": [A, True, {"type": "object", "required": ["b"]}, {"properties": {"b": {"type": "integer"}}}]}])
def test_all_of_branches_make_one_closed_object(tok, schema):
  """Each branch closed alone refused the other's property: the schema could not compile
  ("Unsatisfiable schema"), though {"a": 1, "b": 2} satisfies both branches."""
  assert accepts(tok, schema, '{"a": 1, "b": 2}')
  for text in ('{"a": 1}', '{"b": 2}', '{"a": "x", "b": 2}', '{"a": 1, "b": 2, "z": 3}'):
    assert not accepts(tok, schema, text), text


def test_all_of_with_the_parents_own_properties_and_an_open_branch(tok):
  parent = {"type": "object", "properties": {"c": {"type": "string"}}, "allOf": [A, B]}
  assert accepts(tok, parent, '{"c": "s", "a": 1, "b": 2}') and accepts(tok, parent, '{"a": 1, "b": 2}')
  assert not accepts(tok, parent, '{"c": "s", "a": 1, "b": 2, "z": 3}')
  open_b = {"allOf": [A, {**B, "additionalProperties": True}]}  # one branch admits any other name
  assert accepts(tok, open_b, '{"a": 1, "b": 2, "z": 3}')
  assert not accepts(tok, open_b, '{"a": 1, "b": "x"}')
  # A required name without a property schema: any value, as when one object is closed.
  only_required = {"allOf": [A, {"type": "object", "required": ["z"]}]}
  assert accepts(tok, only_required, '{"a": 1, "z": [true]}')
  assert not accepts(tok, only_required, '{"a": 1}')
  assert not accepts(tok, only_required, '{"a": 1, "z": 1, "y": 2}')


def test_close_objects_of_all_of():
  closed = close_objects({"allOf": [A, B]})
  assert closed == {"allOf": [A, B], "additionalProperties": False, "properties": {"a": {}, "b": {}}}
  strings = {"allOf": [{"type": "string"}, {"maxLength": 3}]}  # no object: nothing to close
  assert close_objects(strings) == strings


def test_mask_covers_the_whole_vocabulary(tok):
  m = JsonMatcher(compile_schema(tok, {"type": "boolean"}, "s"))
  mask = m.mask()
  assert mask.shape == (tok.vocab_size,)
  assert mask.tolist() == [m.allows(i) for i in range(tok.vocab_size)]


def test_reset_starts_a_new_document(tok):
  m = JsonMatcher(compile_schema(tok, A, "s"))
  ids = tok.encode('{"a": 1}')
  for i in ids:
    m.consume(i)
  assert m.complete
  m.reset()
  assert (m.ids, m.text, m.complete, m.accepting) == ([], "", False, False)
  for i in ids:
    m.consume(i)
  assert m.text == '{"a": 1}' and m.complete
