"""Serving configs: configs/horizon.py (model) plus the generation server's settings.

    python -m experiments.serve --checkpoint=/tmp/horizon_tiny/checkpoints \
        --config=configs/serve.py:tiny --port=8000
    python -m experiments.serve --config=configs/serve.py:tiny      # random weights (tests)

When a checkpoint is given, its stored model config wins over the one here
(the weights decide the shapes); every `serving` value comes from this file or
`--config.serving.*` overrides. Every default lives here, once.
"""

import ml_collections

from configs import horizon

VARIANTS = horizon.VARIANTS

# Thinking-token budgets per tier (how many tokens the model may think before
# the engine forces the end-of-thinking token). Real models think for
# thousands of tokens; the CPU variants scale the same ratios down.
_BUDGETS = {
    "tiny": (8, 32, 96),
    "tiny_sharded": (8, 32, 96),
    "small": (64, 512, 2048),
    "agent": (32, 128, 512),
    "full": (2048, 16384, 65536),
}
_SLOTS = {"tiny": 4, "tiny_sharded": 4, "small": 16, "agent": 32, "full": 64}
_CONTEXT = {"tiny": 256, "tiny_sharded": 256, "small": 2048, "agent": 2048, "full": 131072}
_CHUNK = {"tiny": 32, "tiny_sharded": 32, "small": 128, "agent": 256, "full": 8192}
# Prefix cache (serving/prefix_cache.py): memory budget and tokens per block (divides the chunk).
_PREFIX_MB = {"tiny": 64, "tiny_sharded": 64, "small": 1024, "agent": 1024, "full": 65536}
_PREFIX_BLOCK = {"tiny": 16, "tiny_sharded": 16, "small": 64, "agent": 64, "full": 256}


def _serving(variant: str) -> ml_collections.ConfigDict:
  s = ml_collections.ConfigDict()
  s.model_name = f"horizon-{variant}"  # the id /v1/models lists and responses echo
  s.tokenizer = ""  # "" = the bundled tokenizer of the variant (training/assets)
  # Engine: a fixed number of batch slots, each with a decode state of
  # `max_context` tokens (prompt + generated), prefilled `prefill_chunk`
  # tokens at a time. A request longer than max_context is rejected (400).
  s.slots = _SLOTS[variant]
  s.max_context = _CONTEXT[variant]
  s.prefill_chunk = _CHUNK[variant]
  s.max_queue = 1024  # waiting requests beyond this get 429/overloaded
  # Up to this many decode + sample steps per device call while no row needs the host between
  # tokens (serving/decode_loop.py; same tokens as one step per call); 1 = one step per call.
  s.decode_steps = 8
  # False: a decode call computes the fewest rows (2, 4, 8, ..., slots) that hold the decoding requests,
  # one program each (a lone request reads the weights for 2 rows, not `slots`); a request's last bits
  # then depend on how many others decode with it. True: every call computes all slots, so they do not
  # (configs/sft.py sets it for evaluation and RL: resumed runs repeat their episodes exactly).
  s.batch_invariant = False
  # Prefix cache: a request reuses the longest cached prefix of its prompt (per-block DSA state
  # and delta-state snapshots at block ends) and prefills the rest; LRU within the budget.
  s.prefix_cache_mb = _PREFIX_MB[variant]  # 0 = off
  s.prefix_cache_block = _PREFIX_BLOCK[variant]  # tokens per block; divides prefill_chunk
  # True: cache only prefill chunks, resume only at multiples of prefill_chunk, so a resumed
  # request is bit-identical to a cold one (RL sets it); False: completions are cached too.
  s.prefix_cache_exact = False
  s.default_max_tokens = 256  # OpenAI requests without max_(completion_)tokens
  s.seed = 0  # engine RNG for requests without a seed
  low, high, mx = _BUDGETS[variant]
  s.thinking_budgets = ml_collections.ConfigDict({"low": low, "high": high, "max": mx})
  # OpenAI reasoning_effort / Anthropic output_config.effort default when a
  # request asks for nothing; "none" = no thinking unless asked.
  s.default_effort = "none"
  # Limits (400/413 with a message naming the limit). The body limit is checked from
  # Content-Length and while reading, before any parsing; images are bounded in encoded
  # bytes (before base64 decoding) and pixels (from the header, before decoding).
  s.max_images = 8  # per request
  s.max_body_bytes = 16 * 1024 * 1024
  s.max_image_bytes = 5 * 1024 * 1024  # per image, as Anthropic's API
  s.max_image_pixels = 64_000_000  # per image (width x height)
  s.max_tools = 64
  # Compile the engine's programs before /health answers 200 (serving/warmup.py).
  s.warmup = True
  # Auth: "" = open; else requests need `Authorization: Bearer KEY` or `x-api-key: KEY`.
  s.api_key = ""
  # HMAC key for Anthropic thinking-block signatures; "" = a random key per
  # server start (signatures then do not survive a restart).
  s.signing_key = ""
  return s


def get_config(variant: str = "tiny") -> ml_collections.ConfigDict:
  config = horizon.get_config(variant)
  config.serving = _serving(variant)
  return config
