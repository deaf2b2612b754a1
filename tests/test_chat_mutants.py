"""Chat renderer edge cases that mutation testing found unchecked (expected ids written out)."""

import numpy as np
import pytest

from serving.chat import ChatRenderer
from serving.types import ImagePart, Message, TextPart, Tool, ToolCall
from training.tokenizer import default_tokenizer_path, load_tokenizer

TOOL = Tool("add", "Adds.", {"type": "object", "properties": {"a": {"type": "number"}}})
TOOL_LINE = ('{"description":"Adds.","name":"add",'
             '"parameters":{"properties":{"a":{"type":"number"}},"type":"object"}}')


@pytest.fixture(scope="module")
def tok():
  return load_tokenizer(default_tokenizer_path("tiny"))


@pytest.fixture(scope="module")
def renderer(tok):
  return ChatRenderer(tok, 3)


def test_empty_system_message(tok, renderer):
  """An empty first system message still opens the system part; with tools it holds just them."""
  msgs = [Message("system", [TextPart("")]), Message("user", [TextPart("hi")])]
  plain = renderer.render(msgs, add_generation_prompt=False)
  assert tok.decode(plain.ids) == "<|bos|><|system|><|end_of_turn|><|user|>hi<|end_of_turn|>"
  tools = renderer.render(msgs, tools=[TOOL], add_generation_prompt=False)
  assert tok.decode(tools.ids) == ("<|bos|><|system|># Tools\n" + TOOL_LINE + "<|end_of_turn|>"
                                   "<|user|>hi<|end_of_turn|>")


def test_continue_final_without_messages_is_a_value_error(renderer):
  for msgs in ([], [Message("system", [TextPart("s")])]):
    with pytest.raises(ValueError, match="continue_final needs a final assistant message"):
      renderer.render(msgs, continue_final=True)


def test_tool_names_must_be_non_empty(renderer):
  with pytest.raises(ValueError, match=r"tools\[1\]\.name: must be a non-empty string"):
    renderer.render([Message("user", [TextPart("x")])], tools=[TOOL, Tool("", "", {"type": "object"})])


@pytest.mark.parametrize("role", ["assistant", "tool"])
def test_images_only_in_user_messages(renderer, role):
  call = ToolCall("c1", "add", '{"a": 1}')
  msgs = [Message("user", [TextPart("x")]), Message("assistant", [], tool_calls=[call])]
  img = ImagePart(np.random.default_rng(0).random((3, 5, 3), dtype=np.float32))
  bad = Message(role, [TextPart("y"), img], tool_call_id="c1" if role == "tool" else None)
  with pytest.raises(ValueError, match=r"messages\[2\]\.content\[1\]: images are only accepted in user"):
    renderer.render(msgs + [bad])


def test_a_string_is_not_a_message_list(renderer):
  with pytest.raises(ValueError, match="messages: expected a list of Message, got str"):
    renderer.render("hello")


def test_assistant_thinking_is_rendered(tok, renderer):
  msgs = [Message("user", [TextPart("q")]), Message("assistant", [TextPart("a")], thinking="why")]
  ids = renderer.render(msgs, add_generation_prompt=False).ids
  assert tok.decode(ids) == ("<|bos|><|user|>q<|end_of_turn|>"
                             "<|assistant|><|think|>why<|/think|>a<|end_of_turn|>")
