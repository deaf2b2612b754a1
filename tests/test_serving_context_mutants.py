"""serving/context.py, prepare.py and admission.py at the edges a mutation audit found untested: the
limits' lower bounds, the longest-token bound, the prompt-size check counting tool definitions, and the
prefix cache's block dividing the prefill chunk."""

import re
import types

import pytest

from model.config import ConfigError
from serving import prepare
from serving.admission import check_prefix_settings
from serving.chat import tool_line
from serving.context import Limits, max_token_bytes
from serving.errors import APIError
from serving.types import Message, TextPart, Tool


def _limits(**kw):
  base = dict(max_context=256, default_max_tokens=16, max_images=2, max_tools=4, max_body_bytes=1000,
              max_image_bytes=1000, max_image_pixels=1000, thinking_budgets={"low": 8, "high": 32, "max": 64},
              default_effort="none")
  return Limits(**{**base, **kw})


def test_limits_take_their_smallest_valid_values():
  """0 thinking tokens, 0 images and 0 tools are valid (">= 0"); sizes must be >= 1."""
  lim = _limits(thinking_budgets={"low": 0, "high": 0, "max": 0}, max_images=0, max_tools=0, max_context=1,
                default_max_tokens=1, max_body_bytes=1, max_image_bytes=1, max_image_pixels=1)
  assert lim.thinking_budgets["low"] == 0 and lim.max_images == lim.max_tools == 0
  for field in ("max_context", "default_max_tokens", "max_body_bytes", "max_image_bytes", "max_image_pixels"):
    with pytest.raises(ConfigError, match=re.escape(f"config.serving.{field}=0: must be a positive int")):
      _limits(**{field: 0})
  with pytest.raises(ConfigError, match=re.escape("config.serving.max_images=-1: must be an int >= 0")):
    _limits(max_images=-1)
  with pytest.raises(ConfigError, match=re.escape("{'max': None} must be ints >= 0")):
    _limits(thinking_budgets={"low": 1, "high": 2})


def test_max_token_bytes_reads_every_id_and_counts_utf8_bytes():
  texts = ["a", "bc", "", "\u00e9\u00e9", "\U0001F600x"]  # 1, 2, 0, 4 and 5 bytes: the longest is the last id
  tok = types.SimpleNamespace(vocab_size=len(texts), decode=lambda ids: "".join(texts[i] for i in ids))
  assert max_token_bytes(tok) == 5
  assert max_token_bytes(types.SimpleNamespace(vocab_size=1, decode=lambda ids: "")) == 1  # never 0


def test_check_prompt_size_counts_the_tools_text():
  """The tools' lines are rendered into the prompt: their characters count toward the bound."""
  ctx = types.SimpleNamespace(limits=types.SimpleNamespace(max_context=100), max_token_bytes=1,
                              renderer=types.SimpleNamespace(num_image_tokens=0))
  tool = Tool("f", "d", {"type": "object", "properties": {}})
  line = '{"description":"d","name":"f","parameters":{"properties":{},"type":"object"}}'
  assert tool_line(tool) == line and len(line) == 77
  prepare.check_prompt_size(ctx, [Message("user", [TextPart("u" * 22)])], [tool])  # 77 + 22 = 99 < 100
  prepare.check_prompt_size(ctx, [Message("user", [TextPart("u" * 23)])], [])  # 23 alone fits
  with pytest.raises(APIError, match="at least 100 tokens"):
    prepare.check_prompt_size(ctx, [Message("user", [TextPart("u" * 23)])], [tool])


def test_the_prefix_block_must_divide_the_prefill_chunk_when_the_cache_is_on():
  check_prefix_settings(4, 8, 32)
  check_prefix_settings(4, 32, 32)
  check_prefix_settings(0, 7, 32)  # the cache is off: the block does not matter
  for block in (7, 64, 0):
    message = f"prefix_cache_block={block} must be a positive divisor"
    with pytest.raises(ConfigError, match=re.escape(message)):
      check_prefix_settings(4, block, 32)
