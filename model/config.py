"""Typed, validated view of the `model` section of a config.

Defaults live in `configs/*.py` only; these dataclasses have none, so a field
missing from a config is an error that names it. `validate()` turns bad values
into errors a person can act on (field name, value, the fix).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp

LAYER_KINDS = ("dsa", "delta")
FFN_KINDS = ("dense", "moe")
_DTYPES = ("float32", "bfloat16", "float16")
KERNELS = ("auto", "xla", "pallas")
QUANTIZATIONS = ("none", "experts", "all-linear")
# Fields that say how loaded weights are computed with (precision, remat, kernels, blocking, the
# expert exchange) or planned stage changes (the indexer's stage, a longer context), not which
# weights there are: a resumed run or a served checkpoint may set them; any other field is the
# checkpoint's.
RUNTIME_FIELDS = frozenset({
    "dtype", "remat", "scan_layers", "kernels", "expert_exchange", "capacity_factor",
    "dsa_query_block", "dsa_key_block", "dsa_dense_len", "delta_chunk_size", "indexer_stage",
    "max_seq_len"})


class ConfigError(ValueError):
  """A config field has a missing, unknown or invalid value."""


def is_int(value: Any, *, numpy: bool = False) -> bool:
  """An int that is not a bool (True would count as 1 layer, expert, token, ...); numpy=True also
  takes NumPy's integers (callers that convert them before they reach JSON or a config)."""
  kinds = numbers.Integral if numpy else int
  return isinstance(value, kinds) and not isinstance(value, bool)


def _validate_vision(v: "VisionConfig") -> None:
  if not isinstance(v.enabled, bool):
    raise ConfigError(f"config.model.vision.enabled={v.enabled!r}: must be True or False.")
  if not v.enabled:
    return
  for f in ("image_size", "patch_size", "num_channels", "width", "depth", "num_heads", "mlp_dim"):
    value = getattr(v, f)
    if not is_int(value) or value < 1:
      raise ConfigError(f"config.model.vision.{f}={value!r}: must be a positive int.")
  if v.image_size % v.patch_size:
    raise ConfigError(f"config.model.vision.image_size={v.image_size} is not a multiple of "
                      f"patch_size={v.patch_size}.")
  if v.width % v.num_heads:
    raise ConfigError(f"config.model.vision.width={v.width} is not divisible by "
                      f"num_heads={v.num_heads}.")


def _from_mapping(cls, mapping: Any, where: str):
  d = dict(mapping.items()) if hasattr(mapping, "items") else dict(mapping)
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(d) - names)
  missing = sorted(names - set(d))
  if unknown:
    raise ConfigError(f"{where}: unknown field(s) {unknown}; known fields: {sorted(names)}.")
  if missing:
    raise ConfigError(f"{where}: missing field(s) {missing}; add them to the config file.")
  return d


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  enabled: bool
  image_size: int
  patch_size: int
  num_channels: int
  width: int
  depth: int
  num_heads: int
  mlp_dim: int

  @property
  def num_patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Model hyper-parameters; see configs/horizon.py for meanings and values."""
  vocab_size: int
  d_model: int
  num_layers: int
  dsa_period: int
  dsa_offset: int
  num_dense_layers: int
  dense_ffn_dim: int
  norm_eps: float
  max_seq_len: int
  rope_theta: float
  num_heads: int
  q_lora_rank: int
  kv_lora_rank: int
  qk_nope_dim: int
  qk_rope_dim: int
  v_head_dim: int
  index_heads: int
  index_head_dim: int
  index_topk: int
  indexer_stage: str
  dsa_query_block: int
  dsa_key_block: int
  dsa_dense_len: int
  delta_qk_heads: int
  delta_v_heads: int
  delta_qk_dim: int
  delta_v_dim: int
  delta_conv_size: int
  delta_chunk_size: int
  num_experts: int
  experts_per_token: int
  expert_dim: int
  num_shared_experts: int
  router_score: str
  router_groups: int
  router_topk_groups: int
  routed_scaling: float
  norm_topk_prob: bool
  expert_exchange: str
  capacity_factor: float
  vision: VisionConfig
  image_token_id: int
  param_dtype: str
  dtype: str
  remat: str
  scan_layers: bool
  kernels: str
  quantization: str

  @classmethod
  def from_config(cls, model_cfg: Any) -> "ModelConfig":
    """Builds from the `config.model` ConfigDict (or a plain mapping)."""
    d = _from_mapping(cls, model_cfg, "config.model")
    d["vision"] = VisionConfig(**_from_mapping(VisionConfig, d["vision"], "config.model.vision"))
    cfg = cls(**d)
    cfg.validate()
    return cfg

  def replace(self, **changes) -> "ModelConfig":
    cfg = dataclasses.replace(self, **changes)
    cfg.validate()
    return cfg

  # ---- derived -------------------------------------------------------------
  @property
  def layer_kinds(self) -> tuple[str, ...]:
    """Per-layer attention kind: 'dsa' or 'delta'."""
    return tuple("dsa" if i % self.dsa_period == self.dsa_offset else "delta"
                 for i in range(self.num_layers))

  @property
  def ffn_kinds(self) -> tuple[str, ...]:
    """Per-layer feed-forward kind: 'dense' for the first layers, then 'moe'."""
    return tuple("dense" if i < self.num_dense_layers else "moe" for i in range(self.num_layers))

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def jnp_param_dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def use_pallas(self) -> bool:
    """Whether the Pallas kernels run ("auto": on TPU/GPU, not on CPU)."""
    if self.kernels == "auto":
      return jax.default_backend() in ("tpu", "gpu")
    return self.kernels == "pallas"

  # ---- validation ----------------------------------------------------------
  def validate(self) -> None:
    def need(cond: bool, field: str, msg: str):
      if not cond:
        raise ConfigError(f"config.model.{field}={getattr(self, field, '?')!r}: {msg}")

    for f in ("vocab_size", "d_model", "num_layers", "dense_ffn_dim", "max_seq_len", "num_heads",
              "q_lora_rank", "kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim",
              "index_heads", "index_head_dim", "index_topk", "dsa_query_block", "dsa_key_block",
              "delta_qk_heads", "delta_v_heads", "delta_qk_dim", "delta_v_dim",
              "delta_conv_size", "delta_chunk_size", "num_experts", "experts_per_token",
              "expert_dim", "dsa_period"):
      need(is_int(getattr(self, f)) and getattr(self, f) > 0, f, "must be a positive int.")
    # Counts and ids that may be 0: a float (1.5 shared experts, 1.5 dense layers) or a bool
    # passed the range checks below and built a different model than asked for.
    for f in ("dsa_offset", "num_dense_layers", "dsa_dense_len", "num_shared_experts", "router_groups",
              "router_topk_groups", "image_token_id"):
      need(is_int(getattr(self, f)), f, "must be an int.")
    for f, why in (("norm_eps", "the RMSNorm epsilon"), ("rope_theta", "the RoPE base"),
                   ("routed_scaling", "the routed experts' output scale; 0 would switch them off")):
      value = getattr(self, f)
      need(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf, f,
           f"must be a finite number > 0 ({why}).")
    need(0 <= self.dsa_offset < self.dsa_period, "dsa_offset", "must be in [0, dsa_period).")
    need(0 <= self.num_dense_layers <= self.num_layers, "num_dense_layers",
         "must be between 0 and num_layers.")
    need(self.qk_rope_dim % 2 == 0, "qk_rope_dim", "RoPE needs an even number of dims.")
    need(self.qk_rope_dim <= self.index_head_dim, "index_head_dim",
         "the indexer applies RoPE to its first qk_rope_dim dims, so it must be >= qk_rope_dim.")
    need(self.dsa_dense_len >= 0, "dsa_dense_len",
         "must be an int >= 0 (0: the sparse stage always gathers its top-k keys).")
    need(self.indexer_stage in ("dense_warmup", "sparse"), "indexer_stage",
         "choose 'dense_warmup' (only the indexer trains, dense KL) or 'sparse'.")
    need(self.delta_v_heads % self.delta_qk_heads == 0, "delta_v_heads",
         f"must be a multiple of delta_qk_heads={self.delta_qk_heads}.")
    need(self.experts_per_token <= self.num_experts, "experts_per_token",
         f"must be <= num_experts={self.num_experts}.")
    need(self.num_shared_experts >= 0, "num_shared_experts", "must be >= 0.")
    need(self.router_score in ("sigmoid", "softmax"), "router_score", "choose 'sigmoid' or 'softmax'.")
    need(self.router_groups >= 1 and self.num_experts % self.router_groups == 0, "router_groups",
         f"must divide num_experts={self.num_experts} (use 1 to disable group-limited routing).")
    need(1 <= self.router_topk_groups <= self.router_groups, "router_topk_groups",
         f"must be in [1, router_groups={self.router_groups}].")
    per_group = self.num_experts // self.router_groups
    need(self.router_topk_groups * per_group >= self.experts_per_token, "router_topk_groups",
         "the selected groups hold fewer experts than experts_per_token; raise router_topk_groups.")
    need(self.expert_exchange in ("auto", "ragged", "capacity"), "expert_exchange",
         "choose 'auto' (ragged on TPU/GPU, capacity on CPU), 'ragged' (dropless) or 'capacity'.")
    need(isinstance(self.capacity_factor, (int, float)) and not isinstance(self.capacity_factor, bool)
         and 0 < self.capacity_factor < math.inf, "capacity_factor",
         "must be a finite number > 0 (>= the expert mesh axis size never drops).")
    need(isinstance(self.norm_topk_prob, bool), "norm_topk_prob", "must be True or False.")
    need(self.remat in ("none", "full", "save_dots"), "remat", "choose 'none', 'full' or 'save_dots'.")
    need(isinstance(self.scan_layers, bool), "scan_layers", "must be True or False.")
    need(self.kernels in KERNELS, "kernels", f"choose one of {KERNELS}.")
    need(self.quantization in QUANTIZATIONS, "quantization", f"choose one of {QUANTIZATIONS}.")
    for f in ("dtype", "param_dtype"):
      need(getattr(self, f) in _DTYPES, f, f"choose one of {_DTYPES}.")
    need(0 <= self.image_token_id < self.vocab_size, "image_token_id",
         f"must be a token id below vocab_size={self.vocab_size}.")
    # The slowest RoPE frequency must not complete a turn within the context,
    # or distant positions alias nearby ones.
    longest_wavelength = 2 * math.pi * self.rope_theta ** ((self.qk_rope_dim - 2) / self.qk_rope_dim)
    need(longest_wavelength >= self.max_seq_len, "rope_theta",
         f"longest RoPE wavelength {longest_wavelength:.3g} < max_seq_len={self.max_seq_len}; "
         "raise rope_theta.")
    _validate_vision(self.vision)


def model_config(config: Any) -> ModelConfig:
  """The validated ModelConfig of a whole run config (a configs/*.py result): its `model` section."""
  if config is None or not hasattr(config, "model"):
    raise ConfigError(f"config {type(config).__name__} has no `model` section; load a configs/*.py "
                      "file, e.g. --config=configs/horizon.py:tiny.")
  return ModelConfig.from_config(config.model)


def with_runtime_overrides(cfg: ModelConfig, overrides: Any, source: str) -> ModelConfig:
  """A checkpoint's `cfg` with the `config.model` fields set on the command line (`overrides`,
  e.g. {'kernels': 'pallas'}; nested ones as 'vision.image_size') applied where they are
  RUNTIME_FIELDS. Any other field the weights fix: a different value is refused, naming it,
  instead of being dropped silently."""
  fixed, runtime, unknown = [], {}, []
  for key, value in dict(overrides or {}).items():
    if key in RUNTIME_FIELDS:
      runtime[key] = value
      continue
    have: Any = cfg
    for part in key.split("."):
      if not dataclasses.is_dataclass(have) or part not in {f.name for f in dataclasses.fields(have)}:
        unknown.append(f"config.model.{key}")  # a typo compared equal to itself and was dropped
        break
      have = getattr(have, part)
    else:
      if have != value:
        fixed.append(f"config.model.{key}={value!r} ({source} has {have!r})")
  if unknown:
    raise ConfigError(f"{', '.join(unknown)}: no such model field; check the spelling.")
  if fixed:
    hint = (" MXFP4 weights come from `python -m experiments.quantize`." if
            any(f.startswith("config.model.quantization=") for f in fixed) else "")
    raise ConfigError(f"{'; '.join(fixed)}: the checkpoint's weights fix these fields; drop the flag(s) "
                      f"(only {', '.join(sorted(RUNTIME_FIELDS))} may differ).{hint}")
  if not runtime:
    return cfg
  out = dataclasses.replace(cfg, **runtime)
  out.validate()
  return out
