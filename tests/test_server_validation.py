"""Request validation shared by both APIs: the Anthropic pydantic models and the error messages.

serving/anthropic_schema.py validates the Messages API body with pydantic;
these cases pin the messages that the hand-written parser it replaced gave
(strict types, null = absent, content-block union tags left out of the path,
custom messages naming the field), so agent middleware keeps reading them.
serving/errors.py formats the first pydantic error in each vendor's words.
"""

import base64
import io
import subprocess
import sys
import time
import types

import numpy as np
import pytest
from PIL import Image

from serving import images
from serving.admission import validate_request
from serving.anthropic_request import InvalidRequest, parse_request
from serving.batch import sampling_args
from serving.errors import loc_to_param, validation_message
from serving.handle import Request, RequestError
from serving.types import SamplingParams

USER = [{"role": "user", "content": "x"}]
TOOL = {"name": "f", "input_schema": {"type": "object"}}


def _parse(serve_config, body, **kw):
  return parse_request(body, serving=serve_config.serving, key=b"key",
                       decode_image=lambda data: images.decode_image(data, 4), **kw)


def _body(messages=USER, **kw):
  return {"model": "m", "max_tokens": 32, "messages": messages, **kw}


@pytest.mark.parametrize("body, message", [
    ({"model": "m", "max_tokens": True, "messages": USER}, "max_tokens: Input should be a valid integer"),
    ({"model": None, "max_tokens": 3, "messages": USER}, "model: Field required"),
    ({"model": "m", "max_tokens": 0, "messages": USER},
     "max_tokens: Input should be greater than or equal to 1"),
    (_body([]), "messages: List should have at least 1 item after validation, not 0"),
    (_body([3]), "messages.0: Input should be a valid dictionary"),
    (_body([{"role": "user", "content": 5}]),
     "messages.0.content: Input should be a valid string or a list of content blocks"),
    (_body([{"role": "user", "content": [{"type": "text"}]}]), "messages.0.content.0.text: Field required"),
    (_body([{"role": "user", "content": [5]}]),
     "messages.0.content.0: Input should be a content block object with a `type`"),
    (_body([{"role": "user", "content": [{"type": "video"}]}]),
     "messages.0.content.0.type: content blocks of type 'video' are not supported by this server"),
    (_body([{"role": "user", "content": [{"type": "text", "text": ""}]}]),
     "messages.0.content.0.text: text content blocks must be non-empty"),
    (_body([{"role": "user", "content": [{"type": "image", "source": {"type": "b64"}}]}]),
     "messages.0.content.0.source.type: Input should be 'base64'"),
    (_body([{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "a b", "name": "f", "input": {}}]}, {"role": "user", "content": "y"}]),
     "messages.1.content.0.id: String should match pattern '^[a-zA-Z0-9_-]+$'"),
    # A reused tool_use id was named by the renderer as 'messages[4].tool_calls[0].id'.
    (_body([{"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "again"},
                                              {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]}]),
     "messages.3.content.1.id: tool_use id 't1' is used by an earlier tool_use block"),
    (_body(system=[{"type": "text", "text": ""}]), "system.0.text: text content blocks must be non-empty"),
    (_body(tools=[TOOL, TOOL]), "tools: Tool names must be unique."),
    (_body(tools=[{"name": "f", "input_schema": {"type": "array"}}]),
     "tools.0.input_schema.type: Input should be 'object'"),
    (_body(tool_choice={"type": "tool"}, tools=[TOOL]), "tool_choice.name: Field required"),
    (_body(tool_choice={"type": "sometimes"}),
     "tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'"),
    (_body(thinking={"type": "enabled"}), "thinking.enabled.budget_tokens: Field required"),
    (_body(thinking={"type": "enabled", "budget_tokens": 0}),
     "thinking.enabled.budget_tokens: Input should be greater than or equal to 1"),
    (_body(thinking={"type": "maybe"}), "thinking.type: Input should be 'enabled', 'disabled' or 'adaptive'"),
    (_body(thinking={"type": "between_tools"}), "thinking.type: 'between_tools' is not supported"),
    (_body(thinking={"type": "adaptive", "display": "hidden"}),
     "thinking.display: Input should be 'summarized' or 'omitted'"),
    (_body(output_config={"effort": "none"}),
     "output_config.effort: Input should be 'low', 'medium', 'high', 'xhigh' or 'max'"),
    (_body(temperature=2), "temperature: Input should be between 0 and 1"),
    (_body(temperature=True), "temperature: Input should be a valid number"),
    (_body(top_p=0), "top_p: Input should be greater than 0 and at most 1"),
    (_body(top_k=-1), "top_k: Input should be greater than or equal to 0"),
    (_body(top_k=2**31), "top_k: Input should be less than or equal to 2147483647"),
    (_body(stop_sequences=["a", " "]),
     "stop_sequences.1: each stop sequence must be a string with non-whitespace characters"),
    (_body(stop_sequences=["a"] * 17), "stop_sequences: at most 16 stop sequences are allowed, got 17"),
    (_body(stop_sequences=["a", "b" * 257]),
     "stop_sequences.1: each stop sequence must be at most 256 characters, got 257"),
    (_body(stream=1), "stream: Input should be a valid boolean"),
    (_body(metadata=[]), "metadata: Input should be a valid dictionary"),
    ([1], "the request body must be a JSON object"),
])
def test_anthropic_error_messages(serve_config, body, message):
  with pytest.raises(InvalidRequest) as e:
    _parse(serve_config, body)
  assert e.value.message.startswith(message), e.value.message
  assert e.value.status == 400


def test_anthropic_nulls_defaults_and_count_tokens(serve_config):
  req = _parse(serve_config, _body(system=None, tools=None, temperature=None, stream=None, metadata=None))
  assert req.params.temperature == 1.0 and req.params.top_p == 1.0 and req.params.top_k == 0
  assert not req.stream and req.tools == [] and [m.role for m in req.messages] == ["user"]
  assert req.params.max_tokens == 32 and isinstance(req.params.temperature, float)
  # count_tokens takes no max_tokens (an invalid one is not read) and no sampling.
  counted = _parse(serve_config, {"model": "m", "max_tokens": "many", "messages": USER}, count_only=True)
  assert counted.messages[0].content[0].text == "x"
  # A string system prompt is one text block; an empty one is no system message.
  assert _parse(serve_config, _body(system="S")).messages[0].content[0].text == "S"
  assert [m.role for m in _parse(serve_config, _body(system="")).messages] == ["user"]


def test_anthropic_stop_sequences_are_capped(serve_config):
  """A million stop sequences are refused at once (the engine thread would scan each at every token)."""
  start = time.monotonic()
  with pytest.raises(InvalidRequest) as e:
    _parse(serve_config, _body(stop_sequences=["a"] * 1_000_000))
  assert e.value.message == "stop_sequences: at most 16 stop sequences are allowed, got 1000000."
  assert time.monotonic() - start < 5
  most = ["s" * 255 + str(i % 10) for i in range(16)]
  assert _parse(serve_config, _body(stop_sequences=most)).stop == most


def test_anthropic_deeply_nested_tool_use_input_is_refused(serve_config):
  """A tool_use input nested too deeply to re-encode is a 400 naming it, not a RecursionError."""
  deep = []
  for _ in range(5000):  # deeper than json.dumps goes
    deep = [deep]
  messages = [{"role": "user", "content": "x"},
              {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                                 "input": {"a": deep}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]}]
  with pytest.raises(InvalidRequest) as e:
    _parse(serve_config, _body(messages, tools=[TOOL]))
  assert e.value.message.startswith("messages.1.content.0.input: nested too deeply"), e.value.message
  assert e.value.status == 400


def test_top_k_beyond_int32_is_refused_by_the_shared_validation(tiny_cfg):
  """The engine's own check (both APIs and direct Engine users) bounds top_k to int32."""
  def check(top_k):
    validate_request(Request([1, 2], SamplingParams(max_tokens=4, top_k=top_k)), max_context=64,
                     vocab_size=tiny_cfg.vocab_size, model_cfg=tiny_cfg, has_vision=False)
  check(2**31 - 1)
  with pytest.raises(RequestError) as e:
    check(2**31)
  assert e.value.param == "top_k" and "[0, 2147483647]" in str(e.value)


def test_sampling_args_clamps_top_k():
  """No row's top_k can raise in the engine step: it is clamped to [0, int32's max]."""
  def slot(top_k):
    return types.SimpleNamespace(params=SamplingParams(max_tokens=4, temperature=0.5, top_k=top_k),
                                 seed=3, generated=[])
  slots = [slot(2**31), slot(10**30), slot(-(2**40)), slot(7), None]
  top_k = sampling_args(slots, [0, 1, 2, 3])[1]
  assert top_k.dtype == np.int32 and top_k.tolist() == [2**31 - 1, 2**31 - 1, 0, 7, 0]


def test_serve_refuses_a_port_out_of_range():
  """--port=70000 is a usage error naming --port before the model loads (not a bind to port 4464)."""
  r = subprocess.run([sys.executable, "-m", "experiments.serve", "--port=70000"], capture_output=True,
                     text=True, timeout=120)
  assert r.returncode != 0 and "--port=70000" in r.stderr and "[0, 65535]" in r.stderr, r.stderr[-2000:]
  assert "loading" not in r.stdout


def test_error_locations_in_each_vendors_style():
  loc = ("body", "messages", 0, "content", 1, "block[text]", "text")
  assert loc_to_param(loc, anthropic=False) == "messages[0].content[1].text"
  assert loc_to_param(loc, anthropic=True) == "messages.0.content.1.text"
  assert loc_to_param(("body", "stop", "str"), anthropic=False) == "stop"
  # A union member's model class is pydantic's, not the client's: it is not part of the field.
  loc = ("body", "tool_choice", "NamedToolChoice", "type")
  assert loc_to_param(loc, anthropic=False) == "tool_choice.type"
  assert loc_to_param(("body",), anthropic=False) is None
  errors = [{"type": "missing", "loc": ("body", "messages"), "msg": "Field required"},
            {"type": "missing", "loc": ("body", "model"), "msg": "Field required"}]
  assert validation_message(errors, anthropic=False) == ("messages: Field required (and 1 more errors)",
                                                          "messages")
  assert validation_message(errors, anthropic=True) == ("messages: Field required", "messages")
  not_object = [{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be an object"}]
  assert "must be a JSON object" in validation_message(not_object, anthropic=False)[0]
  bad_json = [{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error"}]
  assert validation_message(bad_json, anthropic=False)[0].startswith("The request body is not valid JSON")


def test_anthropic_image_data_must_match_its_media_type(serve_config):
  """Anthropic refuses an image whose bytes are not its media_type; the error names the field and
  the type the data is, before anything is decoded."""
  buf = io.BytesIO()
  Image.fromarray(np.random.default_rng(5).integers(0, 256, (7, 5, 3), dtype=np.uint8)).save(buf, "PNG")
  data = base64.b64encode(buf.getvalue()).decode()

  def body(media_type):
    image = {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}
    return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [image]}]}

  decoded = []
  with pytest.raises(InvalidRequest, match=r"messages\.0\.content\.0\.source\.media_type: the image data is "
                     r"image/png, not image/jpeg; set media_type to 'image/png'"):
    parse_request(body("image/jpeg"), serving=serve_config.serving, key=b"k",
                  decode_image=lambda d: decoded.append(d) or images.decode_image(d, 4))
  assert not decoded
  parsed = parse_request(body("image/png"), serving=serve_config.serving, key=b"k",
                         decode_image=lambda d: images.decode_image(d, 4))
  assert parsed.messages[0].content[0].pixels.shape == (4, 4, 3)
