"""What every route of the server shares, as one typed object: `ServerContext`.

`create_app` (serving/server.py) builds it once from the engine and the serve
config (configs/serve.py) and the routes receive it through FastAPI's
dependency injection (`ctx: Context`), so a handler states what it uses and
a type checker sees it -- instead of reading untyped attributes off
`app.state`. `Limits` is the part of `config.serving` the request handling
enforces; the other fields are read once here.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any

import fastapi

from model.config import ConfigError
from serving import signing
from serving.api_common import EFFORT_TIERS
from serving.chat import ChatRenderer

if TYPE_CHECKING:
  from serving.engine import Engine
  from serving.metrics import EngineMetrics


@dataclasses.dataclass(frozen=True)
class Limits:
  """Request limits and thinking defaults (configs/serve.py documents each).

  The attribute names are those of `config.serving`, so functions that read
  these take either (`serving.anthropic_request.parse_request(serving=...)`).
  """
  max_context: int
  default_max_tokens: int
  max_images: int
  max_tools: int
  max_body_bytes: int
  max_image_bytes: int
  max_image_pixels: int
  thinking_budgets: Mapping[str, int]
  default_effort: str

  def __post_init__(self):
    """Bad limits stop the server at start-up, naming the field, instead of failing requests."""
    for name in ("max_context", "default_max_tokens", "max_body_bytes", "max_image_bytes",
                 "max_image_pixels"):
      if getattr(self, name) < 1:
        raise ConfigError(f"config.serving.{name}={getattr(self, name)!r}: must be a positive int.")
    for name in ("max_images", "max_tools"):
      if getattr(self, name) < 0:
        raise ConfigError(f"config.serving.{name}={getattr(self, name)!r}: must be an int >= 0.")
    tiers = sorted({t for t in EFFORT_TIERS.values() if t})
    bad = {t: self.thinking_budgets.get(t) for t in tiers
           if not isinstance(self.thinking_budgets.get(t), int) or self.thinking_budgets[t] < 0}
    if bad:
      raise ConfigError(f"config.serving.thinking_budgets: {bad} must be ints >= 0 (tokens of thinking "
                        f"per tier; every tier of {tiers} needs one).")
    if self.default_effort not in EFFORT_TIERS:
      raise ConfigError(f"config.serving.default_effort={self.default_effort!r}: choose one of "
                        f"{list(EFFORT_TIERS)}.")

  @classmethod
  def from_config(cls, serving: Any) -> Limits:
    """The limits of a `config.serving` ConfigDict."""
    return cls(max_context=int(serving.max_context), default_max_tokens=int(serving.default_max_tokens),
               max_images=int(serving.max_images), max_tools=int(serving.max_tools),
               max_body_bytes=int(serving.max_body_bytes), max_image_bytes=int(serving.max_image_bytes),
               max_image_pixels=int(serving.max_image_pixels),
               thinking_budgets={k: int(v) for k, v in dict(serving.thinking_budgets).items()},
               default_effort=str(serving.default_effort))


@dataclasses.dataclass(frozen=True)
class ServerContext:
  """The server's engine and everything the routes read about it.

  Attributes:
    engine: the started engine (the caller of create_app starts and stops it).
    tokenizer: the engine's tokenizer.
    renderer: the chat renderer over that tokenizer (image placeholders of the model).
    model_cfg: the served ModelConfig (a checkpoint's stored config, not config.model).
    limits: request limits and thinking defaults.
    model_name: the id /v1/models lists and responses echo.
    api_key: the key every route but /health needs ("" = open).
    signing_key: HMAC key of Anthropic thinking signatures (serving/signing.py).
    created: unix time the server was built (the model card's `created`).
    max_token_bytes: the most UTF-8 bytes one token decodes to, so a text of n characters
      has at least n / max_token_bytes tokens (serving/prepare.py rejects a prompt whose
      length alone proves it cannot fit the context, before tokenizing it).
  """
  engine: Engine
  tokenizer: Any
  renderer: ChatRenderer
  model_cfg: Any
  limits: Limits
  model_name: str
  api_key: str
  signing_key: bytes
  created: float
  max_token_bytes: int = 1

  @property
  def metrics(self) -> EngineMetrics:
    """The engine's Prometheus series (served at /metrics)."""
    return self.engine.metrics

  @classmethod
  def build(cls, engine: Engine, tokenizer: Any, config: Any) -> ServerContext:
    """The context for `engine` under the serve config (`.serving`; the model config is the engine's)."""
    model_cfg = engine.cfg
    vision = model_cfg.vision
    return cls(engine=engine, tokenizer=tokenizer,
               renderer=ChatRenderer(tokenizer, num_image_tokens=int(vision.num_patches) if vision.enabled
                                     else 0),
               model_cfg=model_cfg, limits=Limits.from_config(config.serving),
               model_name=str(config.serving.model_name), api_key=str(config.serving.api_key or ""),
               signing_key=signing.signing_key(config.serving.signing_key), created=time.time(),
               max_token_bytes=max_token_bytes(tokenizer))

  @property
  def served_models(self) -> list[str]:
    """The model ids requests may name (`model`)."""
    return [self.model_name]


def max_token_bytes(tokenizer: Any) -> int:
  """The longest token's text in UTF-8 bytes (specials included).

  Byte-level BPE: every token is some bytes of the text, so this bounds how
  much text one token can cover. A token holding part of a multi-byte
  character decodes to U+FFFD (3 bytes) per invalid sequence, never fewer bytes
  than it holds, so the bound stays safe.
  """
  return max(1, max(len(tokenizer.decode([i]).encode("utf-8")) for i in range(tokenizer.vocab_size)))


def get_context(request: fastapi.Request) -> ServerContext:
  """The context of the app serving `request` (set by serving.server.create_app)."""
  return request.app.state.context


# A route parameter `ctx: Context` receives the ServerContext.
Context = Annotated[ServerContext, fastapi.Depends(get_context)]
