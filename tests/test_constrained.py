"""Tests for serving.constrained (+ serving.json_automaton, serving.schema_compiler): constrained tool calls.

Random drives pick uniformly among the allowed tokens, which explores odd corners
(long strings, deep fallback values, every tokenization) far more than a model would.
"""

import copy
import itertools
import json
import time

import numpy as np
import pytest

from serving import json_automaton as automaton
from serving.constrained import ToolCallConstraint, _reference_mask, validate_arguments
from serving.types import Tool, ToolChoice
from training.tokenizer import default_tokenizer_path, load_tokenizer

SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "a city"},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit", "K\u00e9lvin"]},
                       "days": {"type": "integer"}},
        "required": ["city"]},
    "plot": {
        "type": "object",
        "properties": {"x": {"type": "number"}, "y": {"type": "number"}, "log": {"type": "boolean"},
                       "nothing": {"type": "null"}, "style": {"enum": [1, 12, "dash", None, [3, "a"]]}},
        "required": ["x", "y", "log"]},
    "tag_items": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1},
                       "grid": {"type": "array", "items": {"type": "array", "items": {"type": "integer"},
                                                           "maxItems": 2}},
                       "code": {"type": "string", "minLength": 3, "maxLength": 3}},
        "required": ["tags", "code"]},
    "create_user": {
        "properties": {
            "user": {"type": "object", "required": ["name", "address"],
                     "properties": {"name": {"type": "string"},
                                    "address": {"type": "object", "required": ["zip"],
                                                "properties": {"zip": {"type": "string", "minLength": 2},
                                                               "street": {"type": "string"}}}}},
            "admin": {"const": True}},
        "required": ["user", "admin", "note"]},  # "note" has no schema: any value
    "ping": {"type": "object"},
    "free_form": {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                       "t": {"type": ["string", "integer", "null"]}, "w": {"type": "object"}},
        "required": ["v", "t"]},
}
TOOLS = [Tool(name, f"the {name} tool", schema) for name, schema in SCHEMAS.items()]
SEP = (", ", ": ")


@pytest.fixture(scope="module")
def toks():
  return {v: load_tokenizer(default_tokenizer_path(v)) for v in ("tiny", "small")}


def sp(tok, name):
  return tok.special_id(name)


def only_allowed(c, tok):
  """Brute force: the ids advance() takes from this state (each on a copy)."""
  out = []
  for i in range(tok.vocab_size):
    try:
      copy.copy(c).advance(i)
      out.append(i)
    except ValueError:
      pass
  return out


def drive(c, tok, rng, *, ref_checks=0, brute_forced=0, stats=None):
  """Random allowed tokens until done; checks masks, forced ids and rejections on the way."""
  ids, bound = [], c.max_tokens
  while not c.done:
    assert len(ids) < bound, "the constrained call did not end within its bound"
    t0 = time.perf_counter()
    allowed = c.next()
    if stats is not None:
      stats.append(time.perf_counter() - t0)
    if isinstance(allowed, np.ndarray):
      assert allowed.shape == (tok.vocab_size,) and allowed.dtype == bool
      choices = np.flatnonzero(allowed)
      assert choices.size >= 2, "a single allowed token must be returned as a forced id"
      if ref_checks > 0 and rng.random() < 0.3:
        ref_checks -= 1
        np.testing.assert_array_equal(allowed, _reference_mask(c._grammar.vocab, c._stack))
      before = (c.text, c.next() is allowed)
      bad = int(rng.choice(np.flatnonzero(~allowed)))
      with pytest.raises(ValueError):
        c.advance(bad)
      assert (c.text, c.next() is allowed) == before  # a rejected token changes nothing
      token = int(rng.choice(choices))
    else:
      token = allowed
      if brute_forced > 0:
        brute_forced -= 1
        assert only_allowed(c, tok) == [token]
    c.advance(token)
    ids.append(token)
  assert c.next() is None
  return ids


def check_call(tok, ids, names):
  """The call's structure, canonical JSON text and schema validity; returns the parsed call."""
  assert ids[0] == sp(tok, "tool_call") and ids[-2:] == [sp(tok, "/tool_call"), sp(tok, "end_of_turn")]
  assert not set(ids[1:-2]) & set(tok.special_ids.values())
  text = tok.decode(ids[1:-2])
  call = json.loads(text)
  assert list(call) == ["name", "arguments"] and call["name"] in names
  assert json.dumps(call, separators=SEP) == text  # canonical: re-renders to the same text
  schema = SCHEMAS[call["name"]]
  assert validate_arguments(schema, call["arguments"]) == []
  order = list(schema.get("properties", {})) + [r for r in schema.get("required", [])
                                                 if r not in schema.get("properties", {})]
  keys = list(call["arguments"])
  assert keys == [k for k in order if k in keys]  # schema order, nothing extra
  return call


@pytest.mark.parametrize("variant,runs", [("tiny", 100), ("small", 100)])
def test_random_drives_give_valid_canonical_calls(toks, variant, runs):
  tok = toks[variant]
  rng = np.random.default_rng(7 if variant == "tiny" else 8)
  names = [t.name for t in TOOLS]
  lengths, times, seen = [], [], set()
  for run in range(runs):
    named = run % 2 == 1
    choice = ToolChoice("named", names[(run // 2) % len(names)]) if named else ToolChoice("required")
    c = ToolCallConstraint(tok, TOOLS, choice)
    ids = drive(c, tok, rng, ref_checks=2 if run % 4 == 0 else 0,
                brute_forced=(40 if variant == "tiny" else 2) if run < 10 else 0, stats=times)
    call = check_call(tok, ids, [choice.name] if named else names)
    seen.add(call["name"])
    lengths.append(len(ids))
  assert seen == set(names)
  print(f"\n{variant}: {runs} calls, tokens median {np.median(lengths):.0f} max {max(lengths)}; next() "
        f"median {np.median(times) * 1e3:.3f} ms p99 {np.quantile(times, 0.99) * 1e3:.2f} ms "
        f"max {max(times) * 1e3:.2f} ms")


def _depth_and_strings(value, strings):
  """Container nesting depth of a JSON value; collects its strings and keys."""
  if isinstance(value, str):
    strings.append(value)
  if isinstance(value, dict):
    strings.extend(value)
    value = list(value.values())
  if not isinstance(value, list):
    return 0
  return 1 + max((_depth_and_strings(v, strings) for v in value), default=0)


def test_small_bounds_and_free_keys(toks):
  """Tight bounds: 1-char free keys stay distinct, depth, item and length caps hold."""
  tok = toks["tiny"]
  rng = np.random.default_rng(3)
  tool = Tool("free_form", "", SCHEMAS["free_form"])
  for _ in range(40):
    c = ToolCallConstraint(tok, [tool], ToolChoice("required"), max_string_chars=1, max_array_items=3,
                           max_number_chars=3, max_depth=2)
    call = check_call(tok, drive(c, tok, rng, ref_checks=5), ["free_form"])
    for v in call["arguments"].values():
      strings = []
      assert _depth_and_strings(v, strings) <= 2
      assert all(len(x) <= 1 for x in strings)
  head = '{"name": "free_form", "arguments": {"v": {"a": 1, "'
  assert automaton.walk(c._stack, 'b') is None  # c is done: nothing may follow
  fresh = ToolCallConstraint(tok, [tool], ToolChoice("required"), max_string_chars=1)
  start = automaton.walk(fresh._stack, head)
  assert automaton.walk(start, "b") is not None and automaton.walk(start, '"') is not None
  assert automaton.walk(start, "a") is None  # a 1-char key equal to a used one could never close


def feed_text(tok, c, text):
  """Feeds the canonical tokenization of a call; True if the constraint ends done."""
  try:
    for i in [sp(tok, "tool_call"), *tok.encode(text), sp(tok, "/tool_call"), sp(tok, "end_of_turn")]:
      c.advance(i)
  except ValueError:
    return False
  return c.done


@pytest.mark.parametrize("name,args", [
    ("get_weather", {"city": "Z\u00fcrich \"old\" \\ town\n\t\x01\u2028", "days": -3}),
    ("get_weather", {"city": "", "unit": "K\u00e9lvin"}),
    ("plot", {"x": 0.0001, "y": -0.0, "log": True, "style": [3, "a"]}),
    ("plot", {"x": 12.5, "y": 1234567, "log": False, "nothing": None, "style": 1}),
    ("tag_items", {"tags": ["a", "bcdef"], "grid": [[], [1, -20]], "code": "xyz"}),
    ("create_user", {"user": {"name": "n", "address": {"zip": "12"}}, "admin": True, "note": [{"k": 0}]}),
    ("ping", {}),
    ("free_form", {"v": {"a": [1, "x"], "b": None}, "t": None, "w": {}}),
])
def test_accepts_what_json_dumps_renders(toks, name, args):
  """The chat renderer's text (tokenizer.encode of json.dumps) is in the constraint's language."""
  text = json.dumps({"name": name, "arguments": args}, separators=SEP)
  for tok in toks.values():
    assert feed_text(tok, ToolCallConstraint(tok, TOOLS, ToolChoice("required")), text), text
    assert feed_text(tok, ToolCallConstraint(tok, TOOLS, ToolChoice("named", name)), text), text


@pytest.mark.parametrize("text", [
    '{"name":"get_weather", "arguments": {"city": "a"}}',  # separator without space
    '{"name": "get_weather", "arguments": {"days": 1, "city": "a"}}',  # schema order
    '{"name": "get_weather", "arguments": {"days": 1}}',  # required city missing
    '{"name": "get_weather", "arguments": {"city": "a", "zzz": 1}}',  # extra property
    '{"name": "get_weather", "arguments": {"city": "\\u00FC"}}',  # uppercase hex
    '{"name": "get_weather", "arguments": {"city": "\\u000a"}}',  # json.dumps writes \\n
    '{"name": "get_weather", "arguments": {"city": "\\/"}}',
    '{"name": "get_weather", "arguments": {"city": "\\ud83d\\ude00"}}',  # surrogates: not generated
    '{"name": "get_weather", "arguments": {"city": "a", "unit": "kelvin"}}',  # not in the enum
    '{"name": "get_weather", "arguments": {"city": "a", "days": 1.0}}',  # integer
    '{"name": "get_weather", "arguments": {"city": "a", "days": -0}}',
    '{"name": "plot", "arguments": {"x": 1.50, "y": 1, "log": true}}',
    '{"name": "plot", "arguments": {"x": 1e5, "y": 1, "log": true}}',
    '{"name": "plot", "arguments": {"x": 0.00001, "y": 1, "log": true}}',
    '{"name": "plot", "arguments": {"x": 01, "y": 1, "log": true}}',
    '{"name": "plot", "arguments": {"x": 1, "y": 1, "log": true, "style": 2}}',
    '{"name": "tag_items", "arguments": {"tags": [], "code": "xyz"}}',  # minItems
    '{"name": "tag_items", "arguments": {"tags": ["abcdef"], "code": "xyz"}}',  # maxLength
    '{"name": "tag_items", "arguments": {"tags": ["a"], "code": "xy"}}',  # minLength
    '{"name": "tag_items", "arguments": {"tags": ["a"], "grid": [[1, 2, 3]], "code": "xyz"}}',
    '{"name": "tag_items", "arguments": {"tags": ["a","b"], "code": "xyz"}}',
    '{"name": "ping", "arguments": {"a": 1}}',
    '{"name": "free_form", "arguments": {"v": {"a": 1, "a": 2}, "t": 1}}',  # duplicate keys
    '{"name": "nope", "arguments": {}}',
    '{"name": "ping", "arguments": {}} ',
])
def test_rejects_non_canonical_or_invalid_text(toks, text):
  for tok in toks.values():
    assert not feed_text(tok, ToolCallConstraint(tok, TOOLS, ToolChoice("required")), text)


def test_numbers_are_exactly_the_canonical_ones(toks):
  """Every string of <= 4 number characters: accepted iff json.dumps(json.loads(s)) == s."""
  tok = toks["tiny"]
  alphabet = "-0123456789."
  for kind in ("integer", "number"):
    tool = Tool("f", "", {"properties": {"n": {"type": kind}}, "required": ["n"]})
    c = ToolCallConstraint(tok, [tool], ToolChoice("required"))
    start = automaton.walk(c._stack, '{"name": "f", "arguments": {"n": ')
    for n in range(1, 5):
      for chars in itertools.product(alphabet, repeat=n):
        s = "".join(chars)
        try:
          value = json.loads(s)
          want = json.dumps(value) == s and (kind == "number" or isinstance(value, int))
        except ValueError:
          want = False
        end = automaton.walk(start, s + "}}")
        assert (end is not None and automaton.Root.complete(end)) == want, (kind, s)
  need = automaton.number_need
  assert need("0.0001", False) == 0 and need("0.0000", False) == -1
  assert need("12345678901234.5", False) == 0 and need("123456789012345.5", False) == -1
  assert need("12345678901234567", True) == 0 and need("-", True) == 1 and need("-0", False) == 2


def test_none_bans_exactly_tool_call(toks):
  for tok in toks.values():
    c = ToolCallConstraint(tok, TOOLS, ToolChoice("none"))
    mask = c.next()
    assert mask.shape == (tok.vocab_size,) and np.flatnonzero(~mask).tolist() == [sp(tok, "tool_call")]
    with pytest.raises(ValueError, match="none"):
      c.advance(sp(tok, "tool_call"))
    for i in (0, sp(tok, "/tool_call"), sp(tok, "end_of_turn"), tok.vocab_size - 1):
      c.advance(i)
    assert not c.done and c.max_tokens is None and c.next() is mask


def test_forced_markers_and_named_head(toks):
  tok = toks["small"]
  c = ToolCallConstraint(tok, TOOLS, ToolChoice("named", "ping"))
  assert c.next() == sp(tok, "tool_call") and only_allowed(c, tok) == [sp(tok, "tool_call")]
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


def test_bad_tools_and_bounds_raise(toks):
  tok = toks["tiny"]
  req = ToolChoice("required")
  with pytest.raises(ValueError, match="tool_choice 'required' needs at least one tool"):
    ToolCallConstraint(tok, [], req)
  with pytest.raises(ValueError, match="distinct"):
    ToolCallConstraint(tok, [Tool("a"), Tool("a")], req)
  with pytest.raises(ValueError, match=r"tools\[1\]\.parameters must be an object schema"):
    ToolCallConstraint(tok, [Tool("a"), Tool("b", "", {"type": "string"})], req)
  with pytest.raises(ValueError, match=r"tools\[0\]\.parameters\.properties\.s: minLength=3 > maxLength=2"):
    ToolCallConstraint(tok, [Tool("a", "", {"properties": {"s": {"type": "string", "minLength": 3,
                                                                     "maxLength": 2}}})], req)
  with pytest.raises(ValueError, match="no enum/const value"):
    ToolCallConstraint(tok, [Tool("a", "", {"properties": {"s": {"type": "string", "enum": [1, 2]}}})], req)
  with pytest.raises(ValueError, match="max_array_items"):
    ToolCallConstraint(tok, TOOLS, req, max_array_items=0)


def test_validate_arguments_reports_errors():
  schema = SCHEMAS["tag_items"]
  assert validate_arguments(schema, {"tags": ["a"], "code": "xyz"}) == []
  errors = validate_arguments(schema, {"tags": [], "grid": [[1, "2"]], "code": 5})
  assert len(errors) == 3 and any("$.grid[0][1]: expected integer" in e for e in errors)
  assert any("minItems" in e for e in errors) and any("$.code: expected string" in e for e in errors)
  assert validate_arguments(SCHEMAS["get_weather"], {"days": 1}) == ["$: missing required property 'city'"]
  assert validate_arguments({"enum": [1]}, True) and not validate_arguments({"enum": [1]}, 1.0)
  assert validate_arguments({"type": "object", "additionalProperties": False}, {"a": 1})
