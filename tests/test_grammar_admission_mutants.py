"""serving/grammar.py's strict mode and argument validation, and serving/admission.py's request
checks, against references written out here: which JSON documents a closed schema accepts (by
the JSON Schema rules, additionalProperties false where the schema says nothing), the errors
jsonschema reports, and the engine's limits at their exact edges. Each test names the mistake
it catches."""

import math
import types

import numpy as np
import pytest

from serving.admission import validate_engine_args, validate_request
from serving.grammar import JsonMatcher, SchemaError, check_schema, compile_schema, validate_arguments
from serving.handle import Request, RequestError
from serving.types import SamplingParams
from tests.test_grammar import accepts
from training.tokenizer import default_tokenizer_path, load_tokenizer


@pytest.fixture(scope="module")
def tok():
  return load_tokenizer(default_tokenizer_path("tiny"))


A = {"type": "object", "properties": {"a": {"type": "integer"}}}  # closed: only "a"


# ---- strict mode: every object schema is closed, wherever it sits -----------------------------
@pytest.mark.parametrize("schema, ok, extra", [
    (A, '{"a": 1}', '{"a": 1, "b": 2}'),
    ({"properties": {"a": {"type": "integer"}}}, '{"a": 1}', '{"a": 1, "b": 2}'),  # no "type"
    ({**A, "type": ["object", "null"]}, '{"a": 1}', '{"a": 1, "b": 2}'),  # a type list
    ({"type": ["null", "object"]}, "{}", '{"b": 2}'),  # a type list, no properties: only {}
    ({"type": "array", "items": A}, '[{"a": 1}]', '[{"a": 1, "b": 2}]'),
    ({"type": "array", "prefixItems": [A], "items": False}, '[{"a": 1}]', '[{"a": 1, "b": 2}]'),
    ({"anyOf": [A, {"type": "null"}]}, '{"a": 1}', '{"a": 1, "b": 2}'),
    ({"allOf": [A]}, '{"a": 1}', '{"a": 1, "b": 2}'),
    ({"$defs": {"p": A}, "$ref": "#/$defs/p"}, '{"a": 1}', '{"a": 1, "b": 2}'),
    ({"definitions": {"p": A}, "$ref": "#/definitions/p"}, '{"a": 1}', '{"a": 1, "b": 2}'),
    ({"type": "object", "properties": {"o": A}}, '{"o": {"a": 1}}', '{"o": {"a": 1, "b": 2}}'),
])
def test_closed_everywhere(tok, schema, ok, extra):
  assert accepts(tok, schema, ok)
  assert not accepts(tok, schema, extra)


def test_what_closing_leaves_open(tok):
  # patternProperties: keys matching it are declared; others are refused once closed.
  pattern = {"type": "object", "patternProperties": {"^x": {"type": "integer"}}}
  assert accepts(tok, pattern, '{"x1": 1, "zz": 2}')  # says nothing of others: not closed
  assert accepts(tok, {**A, "additionalProperties": True}, '{"a": 1, "b": 2}')
  assert accepts(tok, {**A, "additionalProperties": {"type": "integer"}}, '{"a": 1, "b": 2}')
  assert not accepts(tok, {**A, "additionalProperties": {"type": "integer"}}, '{"a": 1, "b": "s"}')
  # A required name without a property schema stays allowed, with any value.
  required = {**A, "required": ["a", "z"]}
  assert accepts(tok, required, '{"a": 1, "z": [1, "two"]}')
  assert not accepts(tok, required, '{"a": 1}')


def test_check_schema_closes_only_when_asked():
  """Closed, an object with no declared property can hold none: minProperties 1 is unsatisfiable."""
  schema = {"type": "object", "minProperties": 1}
  check_schema(schema, "f", closed=False)
  with pytest.raises(SchemaError, match="^f: unsupported or invalid JSON schema: Unsatisfiable"):
    check_schema(schema, "f")


def test_property_order_is_the_schemas(tok):
  ba = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
  assert accepts(tok, ba, '{"b": 1, "a": 2}')
  assert not accepts(tok, ba, '{"a": 2, "b": 1}')


def test_enum_const_and_nested_arrays(tok):
  enum = {"enum": ["x", 1, None, True]}
  got = [accepts(tok, enum, t) for t in ('"x"', "1", "null", "true", "false", "2")]
  assert got == [True, True, True, True, False, False]
  const = {"const": {"k": [1, 2]}}
  assert accepts(tok, const, '{"k": [1, 2]}') and not accepts(tok, const, '{"k": [1, 3]}')
  grid = {"type": "array", "minItems": 2, "maxItems": 2,
          "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1}}
  assert accepts(tok, grid, "[[1], [2, 3]]")
  assert [accepts(tok, grid, t) for t in ("[[1]]", "[[1], []]", "[[1], [2], [3]]")] == [False] * 3


def test_schemas_that_are_not_json_objects_are_refused():
  for schema in (True, [A], "object"):
    with pytest.raises(SchemaError, match=r"^f: a JSON schema must be an object"):
      check_schema(schema, "f")
  with pytest.raises(SchemaError, match=r"^f: a JSON schema must be JSON"):
    check_schema({"type": "number", "maximum": math.nan}, "f")


def test_matcher_allows_only_vocabulary_ids(tok):
  m = JsonMatcher(compile_schema(tok, A, "s"))
  assert not m.allows(-1) and not m.allows(tok.vocab_size)
  assert m.allows(tok.encode("{")[0])


# ---- validate_arguments ----------------------------------------------------------------------
def test_validate_arguments():
  schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}},
                                             "d": {"type": "string", "format": "date"}}}
  assert validate_arguments(schema, {"a": [1, 2], "d": "2026-12-07"}) == []
  assert validate_arguments(schema, {"a": [1, "x"]}) == ["$.a[1]: 'x' is not of type 'integer'"]
  assert validate_arguments(schema, {"d": "2026-13-01"}) == ["$.d: '2026-13-01' is not a 'date'"]
  assert validate_arguments(False, 1) == ["$: the schema `false` accepts nothing"]
  assert validate_arguments(True, 1) == []


# ---- admission -------------------------------------------------------------------------------
CFG = types.SimpleNamespace(image_token_id=7, max_seq_len=32,
                            vision=types.SimpleNamespace(num_patches=2, image_size=4, num_channels=3))


def _check(ids=(1, 2), images=None, has_vision=False, **params):
  validate_request(Request(list(ids), SamplingParams(**{"max_tokens": 4, **params}), images=images),
                   max_context=16, vocab_size=10, model_cfg=CFG, has_vision=has_vision)


def _param(**kw) -> str:
  with pytest.raises(RequestError) as e:
    _check(**kw)
  return e.value.param


def test_request_limits_at_their_edges():
  _check(ids=[1] * 15, max_tokens=1)  # 15 + 1 = the whole context
  _check(ids=[0, 9], max_tokens=14, temperature=0.0, top_p=1.0, top_k=2**31 - 1, stop_token_ids=[0, 9])
  assert _param(ids=[1] * 17, max_tokens=1) == "prompt"
  assert _param(ids=[1] * 16, max_tokens=1) == "max_tokens"
  assert _param(ids=[1, 2], max_tokens=15) == "max_tokens"
  assert _param(ids=[]) == "prompt"
  assert _param(ids=[-1, 2]) == "prompt" and _param(ids=[1, 10]) == "prompt"
  assert _param(max_tokens=0) == "max_tokens"
  assert _param(temperature=-0.01) == "temperature" and _param(temperature=math.inf) == "temperature"
  assert _param(temperature=math.nan) == "temperature"
  assert _param(top_p=0.0) == "top_p" and _param(top_p=1.01) == "top_p"
  assert _param(top_k=-1) == "top_k" and _param(top_k=2**31) == "top_k"
  assert _param(seed=1.5) == "seed"
  assert _param(stop_token_ids=[-1]) == "stop_token_ids" and _param(stop_token_ids=[10]) == "stop_token_ids"


def test_numpy_integers_are_integers():
  """Python callers pass numpy ints (ids from arrays); they were refused as 'not a positive int'."""
  _check(ids=np.array([1, 2]), max_tokens=np.int64(4), top_k=np.int32(5), seed=np.uint64(3),
         stop_token_ids=[np.int64(9)], temperature=np.float32(0.5), top_p=np.float64(0.9))


def test_wrong_types_are_request_errors():
  """Not a TypeError from inside the check (an unclear 500 at the server)."""
  assert _param(temperature="1") == "temperature" and _param(top_p="1") == "top_p"
  assert _param(stop_token_ids=[1.5]) == "stop_token_ids"  # a float id never matches: silently no stop
  # None failed with a TypeError while iterating; bools read as 1 (max_tokens=True gave one token)
  assert _param(stop_token_ids=None) == "stop_token_ids" and _param(stop_token_ids="12") == "stop_token_ids"
  assert [_param(**{f: True}) for f in ("max_tokens", "top_k", "seed", "temperature", "top_p")] == \
    ["max_tokens", "top_k", "seed", "temperature", "top_p"]
  assert _param(stop_token_ids=[True]) == "stop_token_ids"
  assert _param(max_tokens=np.bool_(True)) == "max_tokens"
  assert _param(ids=[[1, 2], [3]]) == "prompt"  # ragged: numpy's ValueError before
  _check(stop_token_ids=range(2), temperature=1, top_p=1)  # any sequence of ids; ints are numbers


def test_images():
  image = np.zeros((1, 4, 4, 3), np.float32)
  _check(ids=[7, 7, 1], images=image, has_vision=True)
  assert _param(ids=[7, 7, 1], images=image) == "images"  # no vision encoder
  assert _param(ids=[7, 7, 1], images=np.zeros((1, 4, 4, 1), np.float32), has_vision=True) == "images"
  assert _param(ids=[7, 7, 1], images=np.zeros((4, 4, 3), np.float32), has_vision=True) == "images"
  assert _param(ids=[7, 1], images=image, has_vision=True) == "images"  # 1 placeholder for 2 patches
  assert _param(ids=[7, 7, 1]) == "prompt"  # placeholders without images


def test_image_pixel_values():
  """NaN or out-of-range pixels were accepted and gave that request garbage (or NaN) logits."""
  _check(ids=[7, 7, 1], images=np.full((1, 4, 4, 3), 1.0, np.float32), has_vision=True)  # both edges
  _check(ids=[7, 7, 1], images=np.zeros((1, 4, 4, 3), np.uint8), has_vision=True)
  for bad in (np.nan, np.inf, -0.01, 1.01, 255.0):
    image = np.full((1, 4, 4, 3), 0.5, np.float32)
    image[0, 3, 2, 1] = bad
    assert _param(ids=[7, 7, 1], images=image, has_vision=True) == "images", bad
  assert _param(ids=[7, 7, 1], images=np.full((1, 4, 4, 3), "x"), has_vision=True) == "images"


def test_engine_args():
  def check(**kw):
    validate_engine_args(CFG, **{"slots": 1, "max_context": 32, "prefill_chunk": 32, "max_queue": 1, **kw})
  check()
  for kw, needle in [(dict(slots=0), "slots=0"), (dict(max_queue=0), "max_queue=0"),
                     (dict(decode_steps=0), "decode_steps=0"), (dict(max_context=33), "max_context=33"),
                     (dict(max_context=16, prefill_chunk=17), "prefill_chunk=17")]:
    with pytest.raises(ValueError, match=needle):
      check(**kw)
