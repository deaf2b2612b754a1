"""The CAD environment: answer a described part with a solid, scored by volumetric IoU.

One tool, `measure(solid)`, reports the volume, bounding box and number of pieces of any
candidate solid, so the model can check its own work; it never looks at the target. The
grade is the intersection over union of the final answer (the JSON in the last
`<answer>...</answer>`) with the target: a continuous reward for RL. Success is the target part
(`solids.match`): IoU >= 0.9 and no feature missing or extra. IoU alone let a plate without its
hole or a bracket without its drillings succeed (IoU 0.94-0.998).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rl.envs.base import Environment, Grade, ToolError, register
from rl.tasks.answers import extract_answer
from rl.tools import solids
from serving.types import Tool

MEASURE = Tool(
  name="measure",
  description=("Measures a candidate solid: its volume, axis-aligned bounding box (min, max, size) and "
               "number of connected pieces. " + solids.GRAMMAR
               + f" A solid holds at most {solids.MAX_PRIMITIVES} primitives."),
  parameters={
    "type": "object",
    "properties": {"solid": {"type": ["object", "string"],
                             "description": "the solid as a JSON object (or a string holding one)"}},
    "required": ["solid"],
    "additionalProperties": False,
  },
)


@register
class CadEnvironment(Environment):
  """A CAD episode: the `measure` tool over candidate solids; graded by IoU with the target."""

  domain = "cad"

  def tools(self) -> Sequence[Tool]:
    return (MEASURE,)

  def _call(self, name: str, arguments: dict[str, Any]) -> str:
    try:
      report = solids.measure(arguments["solid"])
    except solids.SolidError as e:
      raise ToolError(str(e)) from None
    return json.dumps(report.to_json())

  def grade(self, final_text: str) -> Grade:
    """reward = IoU(answer, target); success iff the answer is the target part (`solids.match`);
    bad answers score 0 with a reason."""
    text = extract_answer(final_text)
    try:
      answer = solids.parse_solid(text, "answer")
    except solids.SolidError as e:
      return Grade(0.0, False, {"error": str(e), "answer": text[:200]})
    m = solids.match(answer, self.task["target"])
    return Grade(m.iou, m.success, {"iou": m.iou, "answer_volume": m.answer_volume,
                                    "target_volume": m.target_volume, "volume_apart": m.apart,
                                    "smallest_feature": m.smallest_feature})
