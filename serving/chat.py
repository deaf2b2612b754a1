"""Horizon's chat format: messages -> token ids, one renderer for serving and RL.

The format (token level; `<|...|>` are special ids, never produced by text):

    <|bos|>
    <|system|>{system text}[\\n\\n# Tools\\n{tool lines}][\\n\\nReasoning effort: {tier}]<|end_of_turn|>
    <|user|>{text and images in order; an image = <|image|> x num_image_tokens}<|end_of_turn|>
    <|assistant|><|think|>{thinking}<|/think|>{text}{<|tool_call|>{json}<|/tool_call|>}*<|end_of_turn|>
    <|tool|><|tool_result|>{"name": N, "content": TEXT}<|/tool_result|><|end_of_turn|>
    <|system|>{a later system message, in place}<|end_of_turn|>

and the generation prompt `<|assistant|><|think|>` (thinking on: the model
thinks first) or `<|assistant|><|think|><|/think|>` (thinking off).

Why it is built this way:
  * Trusted template tokens are special ids and every text piece is encoded
    on its own with `allow_special=False`, so user, tool or document text
    typing "<|assistant|>" stays text (no prompt injection through markers).
  * Pieces are encoded separately and concatenated, so rendering is
    append-only: render(msgs) is a prefix of render(msgs + [m]), and the
    generation prompt is a prefix of the rendered assistant reply. Decode
    states can therefore be extended turn by turn and RL can score the exact
    tokens the policy saw.
  * Every earlier assistant message keeps its thinking (history retention):
    in a tool chain the model needs its own earlier reasoning, and dropping
    it would break append-only.
  * Tool-call JSON in history uses exactly the form the constrained decoder
    (serving.constrained) generates: `{"name": N, "arguments": {...}}` with
    json.dumps' default `", "` / `": "` separators.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import numpy as np

from serving.types import EFFORTS, ImagePart, Message, TextPart, Tool, ToolCall, loads_json

ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass
class Rendered:
  """A rendered conversation.

  Attributes:
    ids: [len] token ids, starting with <|bos|>.
    images: the conversation's images in placeholder order, each float32
      [H, W, C]; image i fills placeholders i*P .. (i+1)*P-1 (P = the
      renderer's num_image_tokens).
    num_image_tokens: total number of <|image|> placeholder ids in `ids`
      (= len(images) * P).
  """
  ids: list[int]
  images: list[np.ndarray]
  num_image_tokens: int


def tool_line(tool: Tool) -> str:
  """One compact, key-sorted JSON line describing `tool` for the system part."""
  return json.dumps({"name": tool.name, "description": tool.description, "parameters": tool.parameters},
                    sort_keys=True, separators=(",", ":"))


def tool_call_json(name: str, arguments: dict) -> str:
  """The text between <|tool_call|> and <|/tool_call|> (the constrained decoder's form)."""
  return json.dumps({"name": name, "arguments": arguments}, separators=(", ", ": "))


def tool_result_json(name: str, content: str) -> str:
  """The text between <|tool_result|> and <|/tool_result|>."""
  return json.dumps({"name": name, "content": content}, separators=(", ", ": "))


class ChatRenderer:
  """Renders `serving.types.Message` lists into Horizon's chat format.

  Args:
    tokenizer: a `training.tokenizer.Tokenizer` with Horizon's special tokens.
    num_image_tokens: placeholders per image (config.model.vision.num_patches);
      0 for a model without vision (then images are rejected).
  """

  def __init__(self, tokenizer, num_image_tokens: int):
    if not isinstance(num_image_tokens, int) or num_image_tokens < 0:
      raise ValueError(f"num_image_tokens={num_image_tokens!r}: expected an int >= 0 (the vision "
                       "encoder's patches per image, config.model.vision.num_patches).")
    self.tokenizer = tokenizer
    self.num_image_tokens = num_image_tokens
    self._sp = {name: tokenizer.special_id(name) for name in (
        "bos", "system", "user", "assistant", "tool", "end_of_turn", "think", "/think",
        "tool_call", "/tool_call", "tool_result", "/tool_result", "image")}

  def _text(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, allow_special=False) if text else []

  def render(self, messages: Sequence[Message], *, tools: Sequence[Tool] = (), effort: str | None = None,
             thinking: bool = False, add_generation_prompt: bool = True,
             continue_final: bool = False) -> Rendered:
    """Token ids (and images) of a conversation.

    Args:
      messages: the conversation. A first system message becomes the system
        part (with the tools and effort); later system messages render in place.
      tools: tools the model may call; their JSON schemas go in the system part.
      effort: "low" | "high" | "max" or None; stated in the system part only
        when `thinking` is on.
      thinking: whether the model thinks before answering (generation prompt).
      add_generation_prompt: append the assistant prefix the model continues.
      continue_final: the last message is an assistant answer to continue
        (a "prefill"): it is rendered without its end of turn and no
        generation prompt follows, so generation continues its text.

    Raises:
      ValueError: a malformed message (the message index and field are named)
        or tool, or an unknown effort.
    """
    if effort is not None and effort not in EFFORTS:
      raise ValueError(f"effort={effort!r}: expected one of {list(EFFORTS)} or None.")
    _check_tools(tools)
    calls = _validate(messages, self.num_image_tokens)
    sp = self._sp
    ids: list[int] = [sp["bos"]]
    images: list[np.ndarray] = []
    start = 0
    system_text = None
    if messages and messages[0].role == "system":
      system_text, start = _plain_text(messages[0]), 1
    sections = [] if not system_text else [system_text]
    if tools:
      sections.append("# Tools\n" + "\n".join(tool_line(t) for t in tools))
    if thinking and effort is not None:
      sections.append(f"Reasoning effort: {effort}")
    if system_text is not None or sections:
      ids += [sp["system"], *self._text("\n\n".join(sections)), sp["end_of_turn"]]
    if continue_final:
      last = messages[-1] if len(messages) > start else None
      if last is None or last.role != "assistant" or last.tool_calls:
        raise ValueError(f"messages[{len(messages) - 1}]: continue_final needs a final assistant "
                         "message without tool calls.")
    for m in messages[start:]:
      ids += self._message(m, calls, images)
    if continue_final:
      return Rendered(ids=ids[:-1], images=images,  # drop the end of turn: the answer goes on
                      num_image_tokens=len(images) * self.num_image_tokens)
    if add_generation_prompt:
      ids += [sp["assistant"], sp["think"]] + ([] if thinking else [sp["/think"]])
    return Rendered(ids=ids, images=images, num_image_tokens=len(images) * self.num_image_tokens)

  def render_completion_prompt(self, text: str) -> list[int]:
    """<|bos|> + plain text ids (for /v1/completions); special strings stay text."""
    if not isinstance(text, str):
      raise ValueError(f"prompt: expected a string, got {type(text).__name__}.")
    return [self._sp["bos"], *self._text(text)]

  def _message(self, m: Message, calls: dict[str, ToolCall], images: list[np.ndarray]) -> list[int]:
    sp = self._sp
    if m.role == "system":
      return [sp["system"], *self._text(_plain_text(m)), sp["end_of_turn"]]
    if m.role == "user":
      out = [sp["user"]]
      for part in m.content:
        if isinstance(part, ImagePart):
          out += [sp["image"]] * self.num_image_tokens
          images.append(part.pixels)
        else:
          out += self._text(part.text)
      return out + [sp["end_of_turn"]]
    if m.role == "assistant":
      out = [sp["assistant"], sp["think"], *self._text(m.thinking or ""), sp["/think"]]
      for part in m.content:
        out += self._text(part.text)
      for call in m.tool_calls:
        out += [sp["tool_call"], *self._text(tool_call_json(call.name, json.loads(call.arguments))),
                sp["/tool_call"]]
      return out + [sp["end_of_turn"]]
    name = calls[m.tool_call_id].name  # role "tool"; _validate checked the id
    return [sp["tool"], sp["tool_result"], *self._text(tool_result_json(name, _plain_text(m))),
            sp["/tool_result"], sp["end_of_turn"]]


# ------------------------------------------------------------- validation --


def _plain_text(m: Message) -> str:
  return "".join(p.text for p in m.content)


def _check_tools(tools: Sequence[Tool]) -> None:
  names = set()
  for j, t in enumerate(tools):
    if not isinstance(t, Tool):
      raise ValueError(f"tools[{j}]: expected serving.types.Tool, got {type(t).__name__}.")
    if not isinstance(t.name, str) or not t.name:
      raise ValueError(f"tools[{j}].name: must be a non-empty string.")
    if t.name in names:
      raise ValueError(f"tools[{j}].name: {t.name!r} is listed twice; tool names must be unique.")
    if not isinstance(t.parameters, dict):
      raise ValueError(f"tools[{j}].parameters ({t.name!r}): must be a JSON schema object (a dict).")
    try:
      tool_line(t)
    except (TypeError, ValueError) as e:
      raise ValueError(f"tools[{j}] ({t.name!r}): not JSON-serialisable: {e}") from None
    names.add(t.name)


def _check_parts(i: int, m: Message, images_ok: bool, num_image_tokens: int) -> None:
  if not isinstance(m.content, list | tuple):
    raise ValueError(f"messages[{i}].content: expected a list of TextPart/ImagePart, "
                     f"got {type(m.content).__name__}.")
  for j, part in enumerate(m.content):
    where = f"messages[{i}].content[{j}]"
    if isinstance(part, TextPart):
      if not isinstance(part.text, str):
        raise ValueError(f"{where}.text: expected a string, got {type(part.text).__name__}.")
    elif isinstance(part, ImagePart):
      if not images_ok:
        raise ValueError(f"{where}: images are only accepted in user messages, not in a "
                         f"{m.role!r} message.")
      if num_image_tokens == 0:
        raise ValueError(f"{where}: this model has no vision encoder; send text only.")
      px = part.pixels
      if not isinstance(px, np.ndarray) or px.ndim != 3:
        raise ValueError(f"{where}.pixels: expected a decoded image array [H, W, C] "
                         f"(serving.images.decode_image), got {getattr(px, 'shape', type(px).__name__)}.")
    else:
      raise ValueError(f"{where}: expected TextPart or ImagePart, got {type(part).__name__}.")


def _check_calls(i: int, m: Message, calls: dict[str, ToolCall]) -> None:
  for j, call in enumerate(m.tool_calls):
    where = f"messages[{i}].tool_calls[{j}]"
    if not isinstance(call, ToolCall):
      raise ValueError(f"{where}: expected serving.types.ToolCall, got {type(call).__name__}.")
    if not isinstance(call.id, str) or not call.id:
      raise ValueError(f"{where}.id: must be a non-empty string (tool messages answer it by id).")
    if call.id in calls:
      raise ValueError(f"{where}.id: {call.id!r} was already used by an earlier tool call; ids "
                       "must be unique in a conversation.")
    if not isinstance(call.name, str) or not call.name:
      raise ValueError(f"{where}.name: must be a non-empty string.")
    try:
      args = loads_json(call.arguments) if isinstance(call.arguments, str) else None
    except json.JSONDecodeError as e:
      raise ValueError(f"{where}.arguments: not valid JSON ({e.msg} at char {e.pos}); expected a "
                       "JSON object as text, e.g. '{\"city\": \"Paris\"}'.") from None
    except ValueError as e:  # NaN, Infinity, 1e999: Python reads them, JSON has none
      raise ValueError(f"{where}.arguments: not valid JSON ({e}).") from None
    except RecursionError:
      raise ValueError(f"{where}.arguments: nested too deeply for the JSON decoder; nest values at most "
                       "a few hundred levels deep.") from None
    if not isinstance(args, dict):
      raise ValueError(f"{where}.arguments: expected a JSON object as text, e.g. '{{\"city\": "
                       f"\"Paris\"}}', got {call.arguments!r:.80}.")
    calls[call.id] = call


def _check_message(i: int, m: Message, calls: dict[str, ToolCall], num_image_tokens: int) -> None:
  if not isinstance(m, Message):
    raise ValueError(f"messages[{i}]: expected serving.types.Message, got {type(m).__name__}.")
  if m.role not in ROLES:
    raise ValueError(f"messages[{i}].role: unknown role {m.role!r}; expected one of {list(ROLES)}.")
  _check_parts(i, m, m.role == "user", num_image_tokens)
  if m.role != "assistant":
    if m.thinking is not None:
      raise ValueError(f"messages[{i}].thinking: only assistant messages carry thinking.")
    if m.tool_calls:
      raise ValueError(f"messages[{i}].tool_calls: only assistant messages carry tool calls.")
  elif m.thinking is not None and not isinstance(m.thinking, str):
    raise ValueError(f"messages[{i}].thinking: expected a string or None, got {type(m.thinking).__name__}.")
  _check_calls(i, m, calls)
  if m.role == "tool":
    if m.tool_call_id not in calls:
      raise ValueError(f"messages[{i}].tool_call_id: {m.tool_call_id!r} matches no tool call of an "
                       "earlier assistant message; a tool result must answer a call made before it.")
    if m.name is not None and m.name != calls[m.tool_call_id].name:
      raise ValueError(f"messages[{i}].name: {m.name!r} differs from the tool "
                       f"{calls[m.tool_call_id].name!r} that call {m.tool_call_id!r} named.")
  elif m.tool_call_id is not None:
    raise ValueError(f"messages[{i}].tool_call_id: only tool messages carry a tool_call_id.")


def _validate(messages: Sequence[Message], num_image_tokens: int) -> dict[str, ToolCall]:
  """Checks every message; returns {tool call id: call} over the conversation."""
  if isinstance(messages, Message | str) or not isinstance(messages, Sequence):
    raise ValueError(f"messages: expected a list of Message, got {type(messages).__name__}.")
  calls: dict[str, ToolCall] = {}
  for i, m in enumerate(messages):
    _check_message(i, m, calls, num_image_tokens)
  return calls
