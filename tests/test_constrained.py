"""Tests for serving.constrained + serving.grammar: constrained tool calls on llguidance.

Random drives pick uniformly among the allowed tokens, which explores odd corners
(long strings, every tokenization) far more than a model would. Validity is checked
with `jsonschema` (an independent implementation of the same Draft 2020-12 schemas).
"""

import json
import re
import time

import jsonschema
import numpy as np
import pytest

from serving.constrained import ToolCallConstraint, validate_arguments
from serving.grammar import close_objects
from serving.types import Tool, ToolChoice
from training.tokenizer import default_tokenizer_path, load_tokenizer

SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "a city", "maxLength": 12},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit", "K\u00e9lvin"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["city"]},
    "plot": {
        "type": "object",
        "properties": {"x": {"type": "number"}, "y": {"type": "number"}, "log": {"type": "boolean"},
                       "nothing": {"type": "null"}, "style": {"enum": [1, 12, "dash", None, [3, "a"]]}},
        "required": ["x", "y", "log"]},
    "tag_items": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1,
                                "maxItems": 3},
                       "grid": {"type": "array", "items": {"type": "array", "items": {"type": "integer"},
                                                           "maxItems": 2}, "maxItems": 2},
                       "code": {"type": "string", "minLength": 3, "maxLength": 3}},
        "required": ["tags", "code"]},
    "create_user": {
        "properties": {
            "user": {"type": "object", "required": ["name", "address"], "properties": {
                "name": {"type": "string", "maxLength": 8},
                "address": {"type": "object", "required": ["zip"], "properties": {
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    "street": {"type": "string", "maxLength": 8}}}}},
            "admin": {"const": True}},
        "required": ["user", "admin", "note"]},  # "note" has no schema: any value
    "ping": {"type": "object"},
    "free_form": {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "integer"}]},
                       "t": {"type": ["string", "integer", "null"], "maxLength": 4}, "w": {"type": "object"}},
        "required": ["v", "t"]},
}
TOOLS = [Tool(name, f"the {name} tool", schema) for name, schema in SCHEMAS.items()]
SEP = (", ", ": ")
_STRING = re.compile(r'"(?:\\.|[^"\\])*"')


@pytest.fixture(scope="module")
def toks():
  return {v: load_tokenizer(default_tokenizer_path(v)) for v in ("tiny", "small")}


def sp(tok, name):
  return tok.special_id(name)


def drive(c, tok, rng, *, bound=30000, stats=None):
  """Random allowed tokens until done; checks masks, forced ids and rejections on the way."""
  ids = []
  while not c.done:
    assert len(ids) < bound, "the constrained call did not end"
    t0 = time.perf_counter()
    allowed = c.next()
    if stats is not None:
      stats.append(time.perf_counter() - t0)
    if isinstance(allowed, np.ndarray):
      assert allowed.shape == (tok.vocab_size,) and allowed.dtype == bool
      choices = np.flatnonzero(allowed)
      assert choices.size >= 2, "a single allowed token must be returned as a forced id"
      before = c.text
      bad = int(rng.choice(np.flatnonzero(~allowed)))
      with pytest.raises(ValueError):
        c.advance(bad)
      assert c.text == before and np.array_equal(c.next(), allowed)  # a rejected token changes nothing
      token = int(rng.choice(choices))
    else:
      token = allowed
    c.advance(token)
    ids.append(token)
  assert c.next() is None
  return ids


def check_call(tok, ids, names):
  """The call's structure, separators, key order and schema validity; returns the parsed call."""
  assert ids[0] == sp(tok, "tool_call") and ids[-2:] == [sp(tok, "/tool_call"), sp(tok, "end_of_turn")]
  assert not set(ids[1:-2]) & set(tok.special_ids.values())
  text = tok.decode(ids[1:-2])
  call = json.loads(text)
  assert list(call) == ["name", "arguments"] and call["name"] in names
  skeleton = _STRING.sub('""', text)  # outside strings: only the canonical ", " and ": " separators
  assert not re.search(r"\s", skeleton.replace(", ", ",").replace(": ", ":")), text
  schema = SCHEMAS[call["name"]]
  jsonschema.validate(call["arguments"], close_objects(schema))
  assert validate_arguments(schema, call["arguments"]) == []
  order = list(schema.get("properties", {})) + [r for r in schema.get("required", [])
                                                 if r not in schema.get("properties", {})]
  keys = list(call["arguments"])
  assert keys == [k for k in order if k in keys]  # schema order, nothing extra
  return call


@pytest.mark.parametrize("variant,runs", [("tiny", 40), ("small", 12)])
def test_random_drives_give_valid_calls(toks, variant, runs):
  tok = toks[variant]
  rng = np.random.default_rng(7 if variant == "tiny" else 8)
  names = [t.name for t in TOOLS]
  lengths, times, seen = [], [], set()
  for run in range(runs):
    named = run % 2 == 1
    choice = ToolChoice("named", names[(run // 2) % len(names)]) if named else ToolChoice("required")
    c = ToolCallConstraint(tok, TOOLS, choice)
    ids = drive(c, tok, rng, stats=times)
    call = check_call(tok, ids, [choice.name] if named else names)
    seen.add(call["name"])
    lengths.append(len(ids))
  assert seen == set(names)
  print(f"\n{variant}: {runs} calls, tokens median {np.median(lengths):.0f} max {max(lengths)}; next() "
        f"median {np.median(times) * 1e3:.3f} ms p99 {np.quantile(times, 0.99) * 1e3:.2f} ms "
        f"max {max(times) * 1e3:.2f} ms")


def feed_text(tok, c, text):
  """Feeds the canonical tokenization of a call; True if the constraint ends done."""
  try:
    for i in [sp(tok, "tool_call"), *tok.encode(text), sp(tok, "/tool_call"), sp(tok, "end_of_turn")]:
      c.advance(i)
  except ValueError:
    return False
  return c.done


@pytest.mark.parametrize("name,args", [
    ("get_weather", {"city": "Z\u00fc \"o\"\\\n\t\x01\u2028", "days": 3}),
    ("get_weather", {"city": "", "unit": "celsius"}),
    ("plot", {"x": 0.0001, "y": -0.0, "log": True, "style": [3, "a"]}),
    ("plot", {"x": 12.5, "y": 1234567, "log": False, "nothing": None, "style": 1}),
    ("tag_items", {"tags": ["a", "bcdef"], "grid": [[], [1, -20]], "code": "xyz"}),
    ("create_user", {"user": {"name": "n", "address": {"zip": "12345"}}, "admin": True, "note": [{"k": 0}]}),
    ("ping", {}),
    ("free_form", {"v": "abcd", "t": None, "w": {}}),
    ("free_form", {"v": -7, "t": 3}),
])
def test_accepts_what_json_dumps_renders(toks, name, args):
  """The chat renderer's text (tokenizer.encode of json.dumps, ASCII escapes) is in the language."""
  text = json.dumps({"name": name, "arguments": args}, separators=SEP)
  for tok in toks.values():
    assert feed_text(tok, ToolCallConstraint(tok, TOOLS, ToolChoice("required")), text), text
    assert feed_text(tok, ToolCallConstraint(tok, TOOLS, ToolChoice("named", name)), text), text


def test_non_ascii_enum_values_are_written_raw(toks):
  """llguidance matches enum/const strings in their raw UTF-8 spelling only (json.dumps'
  ensure_ascii form `K\\u00e9lvin` is refused): the call then re-renders differently."""
  tok = toks["small"]
  for ascii_only, want in ((False, True), (True, False)):
    text = json.dumps({"name": "get_weather", "arguments": {"city": "a", "unit": "K\u00e9lvin"}},
                      separators=SEP, ensure_ascii=ascii_only)
    assert feed_text(tok, ToolCallConstraint(tok, TOOLS, ToolChoice("required")), text) is want


@pytest.mark.parametrize("text", [
    '{"name":"get_weather", "arguments": {"city": "a"}}',  # separator without space
    '{"name": "get_weather", "arguments": {"days": 1, "city": "a"}}',  # schema order
    '{"name": "get_weather", "arguments": {"days": 1}}',  # required city missing
    '{"name": "get_weather", "arguments": {"city": "a", "zzz": 1}}',  # extra property
    '{"name": "get_weather", "arguments": {"city": "\\/"}}',  # json.dumps never writes \\/
    '{"name": "get_weather", "arguments": {"city": "a", "unit": "kelvin"}}',  # not in the enum
    '{"name": "get_weather", "arguments": {"city": "a", "days": 1.5}}',  # integer
    '{"name": "get_weather", "arguments": {"city": "a", "days": 0}}',  # minimum
    '{"name": "get_weather", "arguments": {"city": "a", "days": 15}}',  # maximum
    '{"name": "get_weather", "arguments": {"city": "abcdefghijklm"}}',  # maxLength
    '{"name": "plot", "arguments": {"x": 01, "y": 1, "log": true}}',
    '{"name": "plot", "arguments": {"x": 1, "y": 1, "log": true, "style": 2}}',
    '{"name": "tag_items", "arguments": {"tags": [], "code": "xyz"}}',  # minItems
    '{"name": "tag_items", "arguments": {"tags": ["abcdef"], "code": "xyz"}}',  # maxLength
    '{"name": "tag_items", "arguments": {"tags": ["a"], "code": "xy"}}',  # minLength
    '{"name": "tag_items", "arguments": {"tags": ["a"], "grid": [[1, 2, 3]], "code": "xyz"}}',
    '{"name": "tag_items", "arguments": {"tags": ["a","b"], "code": "xyz"}}',
    '{"name": "create_user", "arguments": {"user": {"name": "n", "address": {"zip": "1234"}}, '
    '"admin": true, "note": 1}}',  # pattern
    '{"name": "create_user", "arguments": {"user": {"name": "n", "address": {"zip": "12345"}}, '
    '"admin": false, "note": 1}}',  # const
    '{"name": "ping", "arguments": {"a": 1}}',  # no properties declared: closed
    '{"name": "free_form", "arguments": {"v": {"a": 1}, "t": 1}}',  # anyOf string | integer
    '{"name": "free_form", "arguments": {"v": 1, "t": true}}',  # type list
    '{"name": "nope", "arguments": {}}',
    '{"name": "ping", "arguments": {}} ',
])
def test_rejects_invalid_or_non_canonical_text(toks, text):
  for tok in toks.values():
    assert not feed_text(tok, ToolCallConstraint(tok, TOOLS, ToolChoice("required")), text)


def test_numbers_are_json_numbers_of_the_type(toks):
  """Every string of <= 3 number characters: an accepted one is a JSON number (an integer without
  '.' or exponent for "integer"); every JSON integer literal is accepted by both types."""
  tok = toks["tiny"]
  alphabet = "-0123456789.e"
  texts = [a + b + c for a in alphabet for b in [""] + list(alphabet) for c in [""] + list(alphabet)
           if b or not c]
  for kind in ("integer", "number"):
    tool = Tool("f", "", {"properties": {"n": {"type": kind}}, "required": ["n"]})
    for s in texts:
      ok = feed_text(tok, ToolCallConstraint(tok, [tool], ToolChoice("required")),
                     '{"name": "f", "arguments": {"n": ' + s + "}}")
      try:
        value = json.loads(s)
        valid = isinstance(value, (int, float)) and (kind == "number" or isinstance(value, int))
      except ValueError:
        valid = False
      assert ok <= valid, (kind, s)  # accepted => valid
      if valid and isinstance(value, int):
        assert ok, (kind, s)


def test_none_bans_exactly_tool_call(toks):
  for tok in toks.values():
    c = ToolCallConstraint(tok, TOOLS, ToolChoice("none"))
    mask = c.next()
    assert mask.shape == (tok.vocab_size,) and np.flatnonzero(~mask).tolist() == [sp(tok, "tool_call")]
    with pytest.raises(ValueError, match="none"):
      c.advance(sp(tok, "tool_call"))
    for i in (0, sp(tok, "/tool_call"), sp(tok, "end_of_turn"), tok.vocab_size - 1):
      c.advance(i)
    assert not c.done and c.next() is mask


def test_forced_markers_and_named_head(toks):
  tok = toks["small"]
  c = ToolCallConstraint(tok, TOOLS, ToolChoice("named", "ping"))
  assert c.next() == sp(tok, "tool_call")
  with pytest.raises(ValueError):
    c.advance(sp(tok, "end_of_turn"))
  c.advance(sp(tok, "tool_call"))
  # The JSON has one possible text: exactly the tokens spelling a prefix of it are allowed.
  text = '{"name": "ping", "arguments": {}}'
  specials = set(tok.special_ids.values())
  want = {i for i in range(tok.vocab_size)
          if i not in specials and tok.decode([i]) and text.startswith(tok.decode([i]))}
  nxt = c.next()
  assert ({nxt} if isinstance(nxt, int) else set(np.flatnonzero(nxt).tolist())) == want
  assert feed_text(tok, c, text[:-1]) is False  # the closing brace is missing


@pytest.mark.parametrize("choice,match", [
    (ToolChoice("named", "nope"), "tool_choice"),
    (ToolChoice("named", None), "tool_choice"),
    (ToolChoice("auto"), "tool_choice"),
])
def test_bad_choices_raise(toks, choice, match):
  with pytest.raises(ValueError, match=match):
    ToolCallConstraint(toks["tiny"], TOOLS, choice)


@pytest.mark.parametrize("params,match", [
    ({"type": "string"}, r"tools\[1\]\.parameters must be an object schema"),
    ({"properties": {"s": {"type": "string", "minLength": 3, "maxLength": 2}}, "required": ["s"]},
     r"tools\[1\]\.parameters: .*unsatisfiable"),
    ({"properties": {"s": {"type": "array", "uniqueItems": True}}}, r"tools\[1\]\.parameters: .*uniqueItems"),
    ({"properties": {"s": {"$ref": "#/$defs/missing"}}}, r"tools\[1\]\.parameters: .*missing"),
    ({"properties": {"s": {"type": "string", "pattern": "(("}}}, r"tools\[1\]\.parameters: .*regex"),
    ({"properties": {"s": {"type": "strng"}}}, r"tools\[1\]\.parameters: .*strng"),
    ({"properties": {"s": {"type": "string", "format": "shoe-size"}}},
     r"tools\[1\]\.parameters: .*shoe-size"),
])
def test_bad_schemas_raise_naming_the_tool(toks, params, match):
  with pytest.raises(ValueError, match=match):
    ToolCallConstraint(toks["tiny"], [Tool("a"), Tool("b", "", params)], ToolChoice("required"))


def test_bad_tools_raise(toks):
  tok = toks["tiny"]
  req = ToolChoice("required")
  with pytest.raises(ValueError, match="tool_choice 'required' needs at least one tool"):
    ToolCallConstraint(tok, [], req)
  with pytest.raises(ValueError, match="distinct"):
    ToolCallConstraint(tok, [Tool("a"), Tool("a")], req)


def test_validate_arguments_reports_errors():
  schema = SCHEMAS["tag_items"]
  assert validate_arguments(schema, {"tags": ["a"], "code": "xyz"}) == []
  errors = validate_arguments(schema, {"tags": [], "grid": [[1, "2"]], "code": 5})
  assert len(errors) == 3 and any(e.startswith("$.grid[0][1]: '2' is not of type 'integer'") for e in errors)
  assert any(e.startswith("$.tags: ") for e in errors)
  assert any(e.startswith("$.code: 5 is not") for e in errors)
  assert validate_arguments(SCHEMAS["get_weather"], {"days": 1}) == ["$: 'city' is a required property"]
  assert validate_arguments(SCHEMAS["get_weather"], {"city": "a", "days": 20})  # maximum
  assert validate_arguments(SCHEMAS["create_user"]["properties"]["user"],
                            {"name": "n", "address": {"zip": "12"}})  # pattern
  assert validate_arguments({"enum": [1]}, True) and not validate_arguments({"enum": [1]}, 1.0)
  assert validate_arguments({"type": "object", "additionalProperties": False}, {"a": 1})
  assert validate_arguments({"type": "strng"}, 1)[0].startswith("$: the schema is invalid")
