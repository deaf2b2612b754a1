"""The Anthropic Messages API (serving/anthropic_api.py) driven by the official `anthropic` SDK.

The session server (tests/conftest.py: `server_url`) runs the random `tiny`
model, so the tests assert structure, invariants, determinism (temperature 0),
budgets (thinking tokens counted with the tokenizer) and error shapes, never
specific words. The tiny context is 256 tokens and its tokenizer is nearly
byte-level, so prompts and tool schemas are kept short. This SDK version has
no `temperature` argument: it goes through `extra_body`, as for any client.
"""

import base64
import io
import json
import time

import anthropic
import httpx
import numpy as np
import pytest
from PIL import Image

from serving import anthropic_api, images, signing
from serving.anthropic_request import InvalidRequest, parse_request
from serving.chat import ChatRenderer
from serving.types import Message, TextPart

KEY = "test-key"
MODEL = "horizon-tiny"  # what the server serves (configs/serve.py:tiny); other names are 404s
GREEDY = {"temperature": 0}
TOOLS = [{"name": "f", "input_schema": {"type": "object", "properties": {"c": {"type": "string",
                                                                           "enum": ["a", "b"]}},
                                         "required": ["c"]}}]


@pytest.fixture(scope="module")
def client(server_url):
  return anthropic.Anthropic(base_url=server_url, api_key=KEY, max_retries=0, timeout=120)


def _create(client, **kw):
  return client.messages.create(model=MODEL, extra_body=GREEDY, **kw)


def _tool_request():
  return dict(max_tokens=64, messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
              tool_choice={"type": "tool", "name": "f"}, thinking={"type": "enabled", "budget_tokens": 4})


@pytest.fixture(scope="module")
def tool_turn(client):
  """A forced call of `f` with thinking on: (request kwargs, response)."""
  kw = _tool_request()
  return kw, _create(client, **kw)


def _error(exc: anthropic.APIStatusError) -> dict:
  body = exc.response.json()
  assert set(body) == {"type", "error"} and body["type"] == "error", body
  assert set(body["error"]) == {"type", "message"}, body
  return body["error"]


# ---- signing (no server) ------------------------------------------------------
def test_signing_sign_verify_and_seal():
  key, other = b"k" * 7, b"other key"
  text = "Denke nach: 2 + 2 = 4 \u2713\n"
  sig = signing.sign_thinking(key, text)
  assert len(base64.b64decode(sig)) == 32
  assert signing.verify_thinking(key, text, sig)
  assert not signing.verify_thinking(key, text + " ", sig)
  assert not signing.verify_thinking(other, text, sig)
  assert not signing.verify_thinking(key, text, sig[:-2] + "AA")
  assert not signing.verify_thinking(key, text, "not base64 \u00e9")
  sealed = signing.seal_thinking(key, text)
  assert text not in base64.b64decode(sealed).decode("latin-1")  # encrypted, not just encoded
  assert signing.seal_thinking(key, text) != sealed  # fresh nonce each time
  assert signing.unseal_thinking(key, sealed) == text
  assert signing.unseal_thinking(other, sealed) is None
  raw = bytearray(base64.b64decode(sealed))
  raw[20] ^= 1
  assert signing.unseal_thinking(key, base64.b64encode(bytes(raw)).decode()) is None
  assert signing.unseal_thinking(key, sealed[:30]) is None
  assert signing.unseal_thinking(key, "%%%") is None
  assert len(signing.signing_key("")) == 32 and signing.signing_key("") != signing.signing_key("")
  assert signing.signing_key("abc") == b"abc"


# ---- request translation (no server) --------------------------------------------
def _parse(serve_config, body, key=b"key", **kw):
  return parse_request(body, serving=serve_config.serving, key=key,
                       decode_image=lambda data: images.decode_image(data, 4), **kw)


def _body(messages, **kw):
  return {"model": MODEL, "max_tokens": 32, "messages": messages, **kw}


def test_images_past_the_limit_are_refused_before_any_is_decoded(serve_config):
  """The count came after every image was decoded: a body of dozens of large images held a worker
  for minutes before its 400. Images inside tool results count too."""
  image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png(5, 3, 1)}}
  limit = serve_config.serving.max_images
  tool_turn = [{"role": "user", "content": "x"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [image]}]
                + [image] * limit}]
  decoded = []
  with pytest.raises(InvalidRequest, match=f"too many images: {limit + 1} > {limit}"):
    parse_request(_body(tool_turn), serving=serve_config.serving, key=b"key",
                  decode_image=lambda data: decoded.append(data) or images.decode_image(data, 4))
  assert not decoded
  at_limit = tool_turn[:2] + [{**tool_turn[2], "content": tool_turn[2]["content"][:-1]}]
  roles = [m.role for m in _parse(serve_config, _body(at_limit)).messages]
  assert roles == ["user", "assistant", "tool", "user"]


def test_parse_translation(serve_config):
  key = b"key"
  sig = signing.sign_thinking(key, "hmm")
  image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png(5, 3, 1)}}
  messages = [
      {"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}]},
      {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": sig},
                                        {"type": "text", "text": "t"},
                                        {"type": "tool_use", "id": "toolu_1", "name": "f",
                                         "input": {"c": "a"}}]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                    "content": [{"type": "text", "text": "bad"}, image]},
                                   {"type": "text", "text": "go on"}]}]
  system = [{"type": "text", "text": "S1"}, {"type": "text", "text": "S2"}]
  req = _parse(serve_config, _body(messages, system=system, tools=TOOLS, tool_choice={"type": "any"},
                                   stop_sequences=["##"], thinking={"type": "enabled", "budget_tokens": 9},
                                   top_k=5), key=key)
  # The tool result's image moves into the user message after the results.
  assert [m.role for m in req.messages] == ["system", "user", "assistant", "tool", "user"]
  assert req.messages[4].content[0].pixels.shape == (4, 4, 3) and req.messages[4].content[1].text == "go on"
  assert req.messages[0].content[0].text == "S1\n\nS2"
  assert [p.text for p in req.messages[1].content] == ["a", "b"]  # consecutive user turns merged
  assistant, tool = req.messages[2], req.messages[3]
  assert assistant.thinking == "hmm" and assistant.tool_calls[0].name == "f"
  assert json.loads(assistant.tool_calls[0].arguments) == {"c": "a"}
  assert tool.tool_call_id == "toolu_1" and tool.content[0].text == "Error: bad" and tool.name == "f"
  assert req.tool_choice.mode == "required" and req.stop == ["##"] and req.params.top_k == 5
  budgets = serve_config.serving.thinking_budgets
  assert (req.thinking, req.thinking_budget) == (True, 9)
  assert req.effort == next(t for t in ("low", "high", "max") if budgets[t] >= 9)
  user = [{"role": "user", "content": "x"}]
  adaptive = _parse(serve_config, _body(user, output_config={"effort": "medium"},
                                        thinking={"type": "adaptive"}))
  assert (adaptive.effort, adaptive.thinking_budget) == ("high", budgets.high)
  off = _parse(serve_config, _body(user, tool_choice={"type": "none"}, tools=TOOLS))
  assert not off.thinking and off.tool_choice.mode == "none"


@pytest.mark.parametrize("body, needle", [
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, "max_tokens: Field required"),
    (_body([{"role": "system", "content": "x"}]), "messages.0.role: Input should be 'user' or 'assistant'"),
    (_body([{"role": "user", "content": "x"}], thinking={"type": "enabled", "budget_tokens": 32}),
     "`max_tokens` must be greater than `thinking.budget_tokens`"),
    (_body([{"role": "user", "content": [{"type": "text", "text": "x"},
                                         {"type": "tool_result", "tool_use_id": "t"}]}]), "come first"),
    (_body([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]),
     "unexpected `tool_use_id`"),
    (_body([{"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
            {"role": "user", "content": "y"}]), "without `tool_result` blocks"),
    (_body([{"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "a"},
                                         {"type": "tool_result", "tool_use_id": "t", "content": "b"}]}]),
     "messages.2.content.1.tool_use_id: `tool_use` id t is answered by an earlier `tool_result`"),
    (_body([{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]),
     "no network"),
    (_body([{"role": "user", "content": "x"}], tools=TOOLS, tool_choice={"type": "tool", "name": "g"}),
     "tool_choice.name"),
    (_body([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
           thinking={"type": "enabled", "budget_tokens": 4}), "prefill) cannot be used with `thinking`"),
    (_body([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y "}]),
     "cannot end with trailing whitespace"),
    (_body([{"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
           tools=TOOLS), "may only hold `text` blocks"),
    (_body([{"role": "assistant", "content": ""}]), "at least one message"),
    (_body([{"role": "user", "content": []}]), "non-empty content"),
    (_body([{"role": "user", "content": "x"}], output_config={"effort": "huge"}), "output_config.effort"),
    (_body([{"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "AAAA"}]},
            {"role": "user", "content": "y"}]), "Invalid `signature` in `thinking` block"),
    (_body([{"role": "user", "content": "x"}], tools=[{"name": "f", "type": "web_search_20250305"}]),
     "not supported"),
])
def test_parse_errors(serve_config, body, needle):
  with pytest.raises(InvalidRequest) as e:
    _parse(serve_config, body)
  assert needle in e.value.message and e.value.status == 400


# ---- the server -----------------------------------------------------------------
def test_create_message_and_count_tokens(client):
  kw = dict(max_tokens=12, system="Be brief.", messages=[{"role": "user", "content": "Hello"}])
  resp = _create(client, **kw)
  assert resp.type == "message" and resp.role == "assistant" and resp.id.startswith("msg_")
  assert resp.model == "horizon-tiny"
  assert all(b.type == "text" for b in resp.content)  # thinking is off by default (default_effort none)
  assert resp.stop_reason in ("end_turn", "max_tokens") and resp.stop_sequence is None
  assert 1 <= resp.usage.output_tokens <= 12
  count = client.messages.count_tokens(model=MODEL, system=kw["system"], messages=kw["messages"])
  assert count.input_tokens == resp.usage.input_tokens


def test_prefill_continues_the_final_assistant_message(client, engine):
  """A final assistant message is continued: the reply holds only the continuation, and it is the
  greedy continuation of exactly the rendered prefix (prompt without end of turn)."""
  from serving.chat import ChatRenderer
  from serving.engine import Request
  from serving.types import Message, SamplingParams, TextPart

  messages = [{"role": "user", "content": "def add(a, b):"},
              {"role": "assistant", "content": "  return"}]
  resp = _create(client, max_tokens=6, messages=messages)  # greedy (GREEDY extra_body)
  assert resp.content and all(b.type == "text" for b in resp.content)
  renderer = ChatRenderer(engine.tokenizer, engine.cfg.vision.num_patches)
  conv = [Message("user", [TextPart("def add(a, b):")]), Message("assistant", [TextPart("  return")])]
  prefix = renderer.render(conv, continue_final=True).ids
  full = renderer.render(conv, add_generation_prompt=False).ids
  assert full[:len(prefix)] == prefix and len(full) == len(prefix) + 1  # only the end of turn is gone
  assert resp.usage.input_tokens == len(prefix)
  ids, _, _ = engine.generate(Request(prompt_ids=prefix, params=SamplingParams(max_tokens=6, temperature=0)))
  want = engine.tokenizer.decode([i for i in ids if i not in engine.default_stop_ids], skip_special=True)
  assert "".join(b.text for b in resp.content) == want
  count = client.messages.count_tokens(model=MODEL, messages=messages)
  assert count.input_tokens == len(prefix)
  # An empty final assistant message is no prefill: a normal new turn.
  plain = _create(client, max_tokens=4, messages=[messages[0], {"role": "assistant", "content": ""}])
  assert plain.usage.input_tokens == client.messages.count_tokens(
      model=MODEL, messages=[messages[0]]).input_tokens


def test_stop_sequence(client):
  kw = dict(max_tokens=12, messages=[{"role": "user", "content": "Say"}])
  text = _create(client, **kw).content[0].text
  # A 2-character piece of the greedy answer (no U+FFFD: those stand for incomplete bytes).
  stop = next(text[i:i + 2] for i in range(1, len(text) - 1)
              if "\ufffd" not in text[i:i + 2] and text[i:i + 2].strip())
  resp = _create(client, stop_sequences=[stop], **kw)
  assert resp.stop_reason == "stop_sequence" and resp.stop_sequence == stop
  assert "".join(b.text for b in resp.content) == text[:text.index(stop)]


def _check_order(types_and_data):
  """Anthropic's stream grammar over (event type, data) pairs, pings removed."""
  events = [(t, d) for t, d in types_and_data if t != "ping"]
  assert events[0][0] == "message_start" and [t for t, _ in events[-2:]] == ["message_delta", "message_stop"]
  index, open_block = 0, None
  for t, d in events[1:-2]:
    if t == "content_block_start":
      assert open_block is None and d["index"] == index
      open_block = d["content_block"]["type"]
    elif t == "content_block_delta":
      assert d["index"] == index and open_block is not None
      allowed = {"thinking": {"thinking_delta", "signature_delta"}, "signed": set(), "text": {"text_delta"},
                 "tool_use": {"input_json_delta"}, "redacted_thinking": set()}[open_block]
      assert d["delta"]["type"] in allowed, (open_block, d)
      if d["delta"]["type"] == "signature_delta":
        open_block = "signed"  # the signature ends a thinking block
    else:
      assert t == "content_block_stop" and d["index"] == index and open_block not in (None, "thinking")
      index, open_block = index + 1, None
  assert open_block is None


def test_stream_matches_create(client, tool_turn):
  kw, expected = tool_turn
  with client.messages.stream(model=MODEL, extra_body=GREEDY, **kw) as stream:
    raw = [(e.type, e.model_dump()) for e in stream
           if e.type in ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
                         "message_delta", "message_stop")]
    final = stream.get_final_message()
  _check_order(raw)
  assert [d["delta"]["type"] for t, d in raw if t == "content_block_delta"][-1] == "input_json_delta"

  def strip(m):
    d = m.model_dump()
    d.pop("id")
    for b in d["content"]:
      b.pop("id", None)  # tool-use ids are random per call
    return d
  assert strip(final) == strip(expected)


def _sse(server_url, body):
  """(event name, data) pairs of a raw streaming request."""
  out, name = [], None
  with httpx.stream("POST", server_url + "/v1/messages", json=body, headers={"x-api-key": KEY},
                    timeout=120) as r:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    for line in r.iter_lines():
      if line.startswith("event: "):
        name = line[7:]
      elif line.startswith("data: "):
        data = json.loads(line[6:])
        assert data["type"] == name
        out.append((name, data))
  return out


def test_raw_stream_events_and_pings(server_url, monkeypatch):
  body = {"model": MODEL, "max_tokens": 6, "stream": True, "temperature": 0, "messages": [
      {"role": "user", "content": "Hi"}], "thinking": {"type": "enabled", "budget_tokens": 2}}
  events = _sse(server_url, body)
  assert [t for t, _ in events[:2]] == ["message_start", "ping"]
  _check_order(events)
  start, delta = events[0][1]["message"], events[-2][1]
  assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
  assert delta["delta"]["stop_reason"] in ("max_tokens", "end_turn") and delta["usage"]["output_tokens"] <= 6
  monkeypatch.setattr(anthropic_api, "PING_INTERVAL_S", 0.002)  # idle pings while the engine works
  events = _sse(server_url, body)
  assert sum(t == "ping" for t, _ in events) > 1
  _check_order(events)


def _thinking_count(tokenizer, text: str) -> int:
  """The tokenizer's count of returned thinking (each U+FFFD stands for >= 1 generated byte token)."""
  return len(tokenizer.encode(text.replace("\ufffd", ""))) + text.count("\ufffd")


def test_thinking_budget(client, engine, serve_config):
  budget = 5
  resp = _create(client, max_tokens=10, messages=[{"role": "user", "content": "Think"}],
                 thinking={"type": "enabled", "budget_tokens": budget})
  block = resp.content[0]
  assert block.type == "thinking" and block.signature
  used = resp.usage.output_tokens_details.thinking_tokens
  assert 0 < used <= budget and _thinking_count(engine.tokenizer, block.thinking) <= budget
  assert resp.usage.output_tokens > used  # thinking was closed and the answer followed
  # adaptive + effort: the tier's budget, and the tier is stated in the prompt (medium -> high).
  renderer = ChatRenderer(engine.tokenizer, num_image_tokens=engine.cfg.vision.num_patches)
  user = [Message("user", [TextPart("Think")])]
  budgets = serve_config.serving.thinking_budgets
  for effort, tier in (("low", "low"), ("medium", "high"), ("xhigh", "max")):
    resp = _create(client, max_tokens=budgets.low + 3, messages=[{"role": "user", "content": "Think"}],
                   thinking={"type": "adaptive"}, output_config={"effort": effort})
    assert resp.content[0].type == "thinking"
    assert resp.usage.input_tokens == len(renderer.render(user, effort=tier, thinking=True).ids)
    used = resp.usage.output_tokens_details.thinking_tokens
    assert 0 < used <= budgets[tier]
    assert _thinking_count(engine.tokenizer, resp.content[0].thinking) <= budgets[tier]


def test_forced_tool_use(tool_turn):
  _, resp = tool_turn
  assert [b.type for b in resp.content] == ["thinking", "tool_use"]
  call = resp.content[1]
  assert call.id.startswith("toolu_") and call.name == "f" and call.input["c"] in ("a", "b")
  assert resp.stop_reason == "tool_use"


def test_tool_round_trip_and_thinking_checks(client, tool_turn):
  kw, resp = tool_turn
  call = resp.content[1]
  result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "ok"}]}

  def follow_up(assistant_content):
    return _create(client, max_tokens=4, messages=kw["messages"] + [
        {"role": "assistant", "content": assistant_content}, result], tools=TOOLS,
        thinking={"type": "enabled", "budget_tokens": 2})
  again = follow_up(resp.content)
  assert again.content[0].type == "thinking" and again.usage.output_tokens <= 4
  thinking = resp.content[0].model_dump()
  altered = dict(thinking, thinking=thinking["thinking"] + "!")
  with pytest.raises(anthropic.BadRequestError) as e:
    follow_up([altered, resp.content[1]])
  error = _error(e.value)
  assert error["type"] == "invalid_request_error" and "Invalid `signature`" in error["message"]
  with pytest.raises(anthropic.BadRequestError) as e:
    follow_up([resp.content[1]])
  assert "Expected `thinking` or `redacted_thinking`, but found `tool_use`" in _error(e.value)["message"]


def test_sealed_thinking_round_trip(client):
  """Redacted (Anthropic's test trigger) and display-omitted thinking come back and are accepted."""
  user = {"role": "user", "content": signing.REDACTED_THINKING_TRIGGER}
  resp = _create(client, max_tokens=5, messages=[user], thinking={"type": "enabled", "budget_tokens": 3})
  assert resp.content[0].type == "redacted_thinking" and resp.content[0].data
  omitted = _create(client, max_tokens=5, messages=[{"role": "user", "content": "Hi"}],
                    thinking={"type": "enabled", "budget_tokens": 3, "display": "omitted"})
  assert omitted.content[0].type == "thinking" and omitted.content[0].thinking == ""
  assert omitted.content[0].signature
  for first, reply in ((user, resp), ({"role": "user", "content": "Hi"}, omitted)):
    history = [first, {"role": "assistant", "content": reply.content}, {"role": "user", "content": "ok"}]
    assert _create(client, max_tokens=2, messages=history).usage.output_tokens <= 2
  tampered = dict(resp.content[0].model_dump(), data=resp.content[0].data[:-8] + "AAAAAAA=")
  with pytest.raises(anthropic.BadRequestError) as e:
    _create(client, max_tokens=2, messages=[user, {"role": "assistant", "content": [tampered]},
                                            {"role": "user", "content": "ok"}])
  assert "redacted_thinking" in _error(e.value)["message"]


def _png(h, w, seed) -> str:
  pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
  buf = io.BytesIO()
  Image.fromarray(pixels).save(buf, format="PNG")
  return base64.b64encode(buf.getvalue()).decode()


def test_image(client, engine):
  image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png(13, 7, 0)}}
  messages = [{"role": "user", "content": [image, {"type": "text", "text": "What?"}]}]
  resp = _create(client, max_tokens=3, messages=messages)
  with_image = client.messages.count_tokens(model=MODEL, messages=messages).input_tokens
  assert resp.usage.input_tokens == with_image
  without = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "What?"}])
  assert with_image - without.input_tokens == engine.cfg.vision.num_patches
  url = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
  with pytest.raises(anthropic.BadRequestError) as e:
    _create(client, max_tokens=3, messages=[{"role": "user", "content": [url]}])
  assert "no network" in _error(e.value)["message"]


def test_errors_in_anthropic_shape(client, server_url):
  r = httpx.post(server_url + "/v1/messages", headers={"x-api-key": KEY},
                 json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
  assert r.status_code == 400
  assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                 "message": "max_tokens: Field required"}}
  with pytest.raises(anthropic.BadRequestError) as e:
    _create(client, max_tokens=4, messages=[{"role": "robot", "content": "x"}])
  assert _error(e.value)["message"].startswith("messages.0.role")
  with pytest.raises(anthropic.BadRequestError) as e:
    _create(client, max_tokens=4, messages=[{"role": "user", "content": "word " * 300}])
  assert _error(e.value)["type"] == "invalid_request_error"
  r = httpx.post(server_url + "/v1/messages", headers={"x-api-key": KEY}, content=b"{not json")
  assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_bad_sampling_and_deep_bodies_are_400s_naming_the_field(client, server_url):
  """A huge top_k, a million stop sequences and a body nested 5000 deep are 400s naming the field;
  none reaches the engine (a top_k past int32 used to end every running request with a 500)."""
  post = lambda body: httpx.post(server_url + "/v1/messages", headers={"x-api-key": KEY}, json=body,
                                 timeout=60)
  body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
  r = post({**body, "top_k": 2**31})
  assert r.status_code == 400 and r.json()["error"]["message"].startswith("top_k: "), r.text
  r = post({**body, "stop_sequences": ["a"] * 1_000_000})
  assert r.status_code == 400 and r.json()["error"]["message"].startswith("stop_sequences: at most 16")
  deep = b'{"model": "horizon-tiny", "max_tokens": 2, "metadata": {"a": ' + b"[" * 5000 + b"]" * 5000
  r = httpx.post(server_url + "/v1/messages", headers={"x-api-key": KEY, "content-type": "application/json"},
                 content=deep + b'}, "messages": [{"role": "user", "content": "x"}]}', timeout=60)
  assert r.status_code == 400, r.text
  assert r.json()["error"] == {"type": "invalid_request_error",
                               "message": r.json()["error"]["message"]}
  assert "nests values too deeply for the JSON decoder" in r.json()["error"]["message"], r.text
  assert _create(client, max_tokens=2, messages=[{"role": "user", "content": "x"}]).content is not None


def test_auth(server_url):
  bad = anthropic.Anthropic(base_url=server_url, api_key="wrong", max_retries=0)
  with pytest.raises(anthropic.AuthenticationError) as e:
    bad.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
  assert e.value.status_code == 401 and _error(e.value)["type"] == "authentication_error"
  for path in ("/v1/messages", "/v1/messages/count_tokens"):
    r = httpx.post(server_url + path, json={"model": MODEL, "messages": []})
    assert r.status_code == 401
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"


def _wait_cancelled(engine, before):
  deadline = time.monotonic() + 20
  while engine.metrics.requests.value(status="cancelled") == before:
    assert time.monotonic() < deadline, "the slot was not freed after the client left"
    time.sleep(0.05)


def test_client_disconnect_frees_the_slot(server_url, engine):
  # Greedy, this prompt runs ~140 tokens (~0.3 s on an idle box): the client leaves long before.
  body = {"model": MODEL, "max_tokens": 240, "temperature": 0,
          "messages": [{"role": "user", "content": "Go on."}]}
  before = engine.metrics.requests.value(status="cancelled")
  with httpx.stream("POST", server_url + "/v1/messages", json=dict(body, stream=True), timeout=60,
                    headers={"x-api-key": KEY}) as r:
    lines = r.iter_lines()
    for _ in range(3):
      next(lines)
  _wait_cancelled(engine, before)
  before = engine.metrics.requests.value(status="cancelled")
  with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
    httpx.post(server_url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=0.05)
  _wait_cancelled(engine, before)
