"""Range checks of config knobs, with errors that name the field and the rule.

Launchers check their knobs before they build data, models or environments, so a bad value
fails in a second with `config.<section>.<name>=<value>: must be ...` rather than minutes later
(or never, running something else than asked).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from model.config import ConfigError


def check_int_knobs(section: str, cfg: Any, table: Iterable[tuple[str, int, str]]) -> None:
  """Each (name, lowest, why) of `table`: cfg[name] must be an int >= lowest (bools are not)."""
  for name, low, why in table:
    value = cfg.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
      reason = f" ({why})" if why else ""
      raise ConfigError(f"config.{section}.{name}={value!r}: must be an int >= {low}{reason}.")


def check_nonnegative_numbers(section: str, cfg: Any, names: Iterable[str]) -> None:
  """Each of `names`: cfg[name] must be a finite number >= 0."""
  for name in names:
    value = cfg.get(name)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
      raise ConfigError(f"config.{section}.{name}={value!r}: must be a finite number >= 0.")
