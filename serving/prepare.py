"""Preparing a generation from an API request: the prompt, its limits and the output processor.

Both front-ends prepare a request the same way: render the conversation with
the one chat renderer (serving/chat.py), check the per-request limits, and
build an `OutputProcessor` (thinking budget, stop strings, tool calls; serving/
output.py) for each generation. The renderer and the processor reject
malformed input with a ValueError naming the field; here it becomes a 400
`APIError`. Running the prepared generation is serving/run.py.

Rendering tokenizes, which costs time in proportion to the text, so it runs
in a worker thread (the callers use `run_in_threadpool`), and a prompt whose
length alone proves it cannot fit the context is refused before any of it is
tokenized (`check_prompt_size`): a token covers at most
`ctx.max_token_bytes` bytes, so n characters are at least n / max_token_bytes
tokens. A body just under the size limit is then refused in microseconds
instead of being tokenized for tens of seconds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from serving.chat import Rendered, tool_call_json, tool_line
from serving.context import ServerContext
from serving.errors import APIError
from serving.output import AUTO, OutputProcessor
from serving.types import ImagePart, Message, ResponseFormat, TextPart, Tool, ToolChoice


def check_model(ctx: ServerContext, model: str) -> None:
  """An unknown `model` -> 404 naming the served models (a missing one is refused by the schemas: 400)."""
  if model not in ctx.served_models:
    served = ", ".join(f"'{m}'" for m in ctx.served_models)
    raise APIError(404, f"The model '{model}' does not exist on this server; it serves {served} "
                   "(GET /v1/models lists them).", param="model", code="model_not_found",
                   type="invalid_request_error")


def refuse_too_long(ctx: ServerContext, chars: int, fixed_tokens: int, param: str) -> None:
  """400 when `chars` characters of text (plus `fixed_tokens`) cannot fit the context.

  Byte-level BPE: a token covers at most ctx.max_token_bytes bytes and a
  character is at least one byte, so the text has at least
  ceil(chars / max_token_bytes) tokens, whatever the tokenizer makes of it.
  """
  context = ctx.limits.max_context
  least = math.ceil(chars / ctx.max_token_bytes) + fixed_tokens
  if least >= context:
    raise APIError(400, f"The prompt has {chars} characters, so at least {least} tokens (one token covers "
                   f"at most {ctx.max_token_bytes} bytes), but this model's context is {context} tokens "
                   "(config.serving.max_context) and must leave room for at least one generated token; "
                   "shorten the input.", param=param, code="context_length_exceeded")


def _message_chars(m: Message) -> tuple[int, int]:
  """(characters of text, images) of one message, as the renderer will write them."""
  chars, images = len(m.thinking or ""), 0
  for part in m.content:
    if isinstance(part, TextPart):
      chars += len(part.text)
    elif isinstance(part, ImagePart):
      images += 1
  for call in m.tool_calls or ():
    chars += _call_chars(call)
  return chars, images


def _call_chars(call) -> int:
  """The characters of a tool call as the renderer writes it: it parses the arguments and writes
  them back (chat.tool_call_json), so whitespace and escapes in them are not what counts."""
  try:
    return len(tool_call_json(call.name, json.loads(call.arguments)))
  except (TypeError, ValueError, RecursionError):  # not JSON: the renderer refuses it (a 400) anyway
    return sum(len(x) for x in (call.name, call.arguments) if isinstance(x, str))


def check_prompt_size(ctx: ServerContext, messages: Sequence[Message], tools: Sequence[Tool],
                      param: str = "messages") -> None:
  """Refuses a conversation whose text alone cannot fit the context (no tokenization; see the module doc)."""
  chars = sum(len(tool_line(t)) for t in tools)
  images = 0
  for m in messages:
    c, i = _message_chars(m)
    chars, images = chars + c, images + i
  refuse_too_long(ctx, chars, images * ctx.renderer.num_image_tokens, param)


def render(ctx: ServerContext, messages: list[Message], *, tools: Sequence[Tool], thinking: bool,
           effort: str | None, continue_final: bool = False) -> Rendered:
  """Renders a conversation with the server's ChatRenderer; renderer ValueErrors become 400s.

  continue_final: the last message is an assistant prefill the generation continues.
  Tokenizes: call it off the event loop. A conversation too long to fit the
  context by its length alone is refused first (check_prompt_size).
  """
  check_prompt_size(ctx, messages, tools)
  try:
    return ctx.renderer.render(messages, tools=tools, effort=effort if thinking else None,
                               thinking=thinking, add_generation_prompt=True, continue_final=continue_final)
  except ValueError as e:
    message = str(e)
    param = message.split(":", 1)[0] if message.startswith(("messages", "tools")) else None
    raise APIError(400, message, param=param and param.split(" ")[0]) from None


def check_images(ctx: ServerContext, n_images: int, param: str) -> None:
  """Too many images -> 400 (config.serving.max_images)."""
  limit = ctx.limits.max_images
  if n_images > limit:
    raise APIError(400, f"The request has {n_images} images; this server accepts at most {limit} per "
                   "request (config.serving.max_images).", param=param)


def make_processor(ctx: ServerContext, *, thinking: bool, thinking_budget: int | None,
                   stop: Sequence[str] = (), tools: Sequence[Tool] = (), tool_choice: ToolChoice = AUTO,
                   call_id_prefix: str = "call_",
                   response_format: ResponseFormat | None = None) -> OutputProcessor:
  """A fresh OutputProcessor for one generation; its ValueErrors become 400s (a schema error
  names its field: serving.grammar.SchemaError)."""
  try:
    return OutputProcessor(ctx.tokenizer, thinking=thinking, thinking_budget=thinking_budget, stop=list(stop),
                           tools=tools, tool_choice=tool_choice, call_id_prefix=call_id_prefix,
                           response_format=response_format)
  except ValueError as e:
    raise APIError(400, str(e), param=getattr(e, "field", None)) from None
