"""Preparing a generation from an API request: the prompt, its limits and the output processor.

Both front-ends prepare a request the same way: render the conversation with
the one chat renderer (serving/chat.py), check the per-request limits, and
build an `OutputProcessor` (thinking budget, stop strings, tool calls; serving/
output.py) for each generation. The renderer and the processor reject
malformed input with a ValueError naming the field; here it becomes a 400
`APIError`. Running the prepared generation is serving/run.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from serving.chat import Rendered
from serving.context import ServerContext
from serving.errors import APIError
from serving.output import AUTO, OutputProcessor
from serving.types import Message, Tool, ToolChoice


def render(ctx: ServerContext, messages: list[Message], *, tools: Sequence[Tool], thinking: bool,
           effort: str | None, continue_final: bool = False) -> Rendered:
  """Renders a conversation with the server's ChatRenderer; renderer ValueErrors become 400s.

  continue_final: the last message is an assistant prefill the generation continues.
  """
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
                   call_id_prefix: str = "call_") -> OutputProcessor:
  """A fresh OutputProcessor for one generation; its ValueErrors become 400s."""
  try:
    return OutputProcessor(ctx.tokenizer, thinking=thinking, thinking_budget=thinking_budget, stop=list(stop),
                           tools=tools, tool_choice=tool_choice, call_id_prefix=call_id_prefix)
  except ValueError as e:
    raise APIError(400, str(e)) from None
