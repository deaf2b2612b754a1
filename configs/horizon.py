"""Horizon model family: one config file, variants by name.

Model, mesh and train sections; configs/pretrain.py adds data, checkpoints and metrics:

    python -m experiments.param_count --config=configs/horizon.py:full
    python -m experiments.quickstart --config=configs/pretrain.py:tiny

Variants:
  tiny  -- unit tests: prime-ish dimensions so shape bugs cannot hide, 4 layers
           (2 Gated DSA + 2 Delta), 8 routed experts, 1 dense FFN layer, DSA
           top-k 16 so sparsity is exercised at test lengths.
  tiny_sharded -- tiny with dims divisible by 8-device meshes (2 layers).
  small -- CPU demo, ~80M total (~22M active) parameters.
  agent -- agent work on CPU (SFT, RL and evaluation in minutes): the 8192-token
           tokenizer (digit by digit), a 4096-token context (2048 served), 4 layers
           of width 128.
  full  -- the seed design: 93 layers (24 Gated DSA + 69 Delta), 608 routed
           experts of width 2048 (top-14) + 1 shared, ~2.80T total / ~104B
           active language-model parameters, 1M-token context.

Every default lives here, once; `model.config.ModelConfig` has no defaults and
validates what it is given.
"""

import ml_collections

VARIANTS = ("tiny", "tiny_sharded", "small", "agent", "full")


def _full_model() -> ml_collections.ConfigDict:
  m = ml_collections.ConfigDict()
  # Trunk.
  m.vocab_size = 163_840
  m.d_model = 8192
  m.num_layers = 93
  # Layer i is Gated DSA when i % dsa_period == dsa_offset, else Delta:
  # 93 layers with period 4, offset 0 -> 24 DSA (0, 4, ..., 92) + 69 Delta.
  m.dsa_period = 4
  m.dsa_offset = 0
  m.num_dense_layers = 3  # the first N layers use a dense FFN, the rest MoE
  m.dense_ffn_dim = 20_480
  m.norm_eps = 1e-6
  # Positions: RoPE on the decoupled MLA/indexer dims only (Delta layers need
  # none). theta is large enough that the longest RoPE wavelength exceeds
  # max_seq_len; ModelConfig.validate checks this.
  m.max_seq_len = 1_048_576
  m.rope_theta = 10_000_000.0
  # Gated DSA: MLA + lightning indexer + sigmoid output gate (DeepSeek-V3.2).
  m.num_heads = 128
  m.q_lora_rank = 1536
  m.kv_lora_rank = 512
  m.qk_nope_dim = 128
  m.qk_rope_dim = 64
  m.v_head_dim = 128
  m.index_heads = 64
  m.index_head_dim = 128
  m.index_topk = 2048
  m.indexer_stage = "sparse"  # "dense_warmup" | "sparse"
  m.dsa_query_block = 256  # queries processed together in the sparse path
  m.dsa_key_block = 2048  # keys scored together by the blockwise top-k
  # Full-sequence calls (training, RL scoring) on sequences up to this length run the sparse stage
  # as dense attention under the exact top-k mask: the same function (selection, attention, KL)
  # with no per-query gather, faster where top-k is a large share of the keys (on XLA:CPU up to
  # ~4 x index_topk: experiments/bench/dsa_masked_dense.py). 0 = always gather.
  m.dsa_dense_len = 0
  # Delta attention: gated delta rule (Gated DeltaNet).
  m.delta_qk_heads = 64
  m.delta_v_heads = 64
  m.delta_qk_dim = 128
  m.delta_v_dim = 128
  m.delta_conv_size = 4
  m.delta_chunk_size = 64
  # MoE.
  m.num_experts = 608
  m.experts_per_token = 14
  m.expert_dim = 2048
  m.num_shared_experts = 1
  m.router_score = "sigmoid"  # "sigmoid" | "softmax"
  m.router_groups = 8  # group-limited routing: experts split into groups ...
  m.router_topk_groups = 4  # ... and only tokens' best groups are eligible
  m.routed_scaling = 2.5
  m.norm_topk_prob = True
  # Expert parallelism (sharding/expert_parallel.py): how tokens reach experts
  # on other devices. "auto": dropless ragged all-to-all on TPU/GPU, the
  # fixed-capacity all-to-all on CPU (which lacks ragged_all_to_all). Each
  # (source, destination) bucket holds ceil(capacity_factor * local
  # assignments / expert shards) rows; overflow is dropped and counted.
  m.expert_exchange = "auto"  # "auto" | "ragged" | "capacity"
  m.capacity_factor = 1.25
  # Vision encoder (ViT + projector); image embeddings replace placeholders.
  m.vision = ml_collections.ConfigDict()
  m.vision.enabled = True
  m.vision.image_size = 448
  m.vision.patch_size = 14
  m.vision.num_channels = 3
  m.vision.width = 1152
  m.vision.depth = 27
  m.vision.num_heads = 16
  m.vision.mlp_dim = 4304
  m.image_token_id = 163_839  # the tokenizer's image placeholder id
  # Numerics and memory.
  m.param_dtype = "bfloat16"
  m.dtype = "bfloat16"
  m.remat = "full"  # "none" | "full" | "save_dots"
  # Trace and compile one period of the layer pattern and jax.lax.scan over its repeats
  # (model/scan.py): the same maths as the unrolled stack, compile time independent of depth.
  m.scan_layers = True
  # Kernels for sparse attention, the indexer top-k, the delta rule and MXFP4
  # matmuls: "pallas" (pallas_kernels/, interpret mode on CPU), "xla" (the
  # plain JAX paths), or "auto" = pallas on TPU/GPU, xla on CPU.
  m.kernels = "auto"
  # Weight storage: "none" (param_dtype everywhere), "experts" (routed expert
  # weights in MXFP4, OCP MX v1.0) or "all-linear" (every linear weight of the
  # language model in MXFP4). Written by experiments/quantize.py.
  m.quantization = "none"
  return m


def _small(m: ml_collections.ConfigDict) -> None:
  m.vocab_size = 8192
  m.d_model = 384
  m.num_layers = 8
  m.dsa_period = 2
  m.num_dense_layers = 1
  m.dense_ffn_dim = 1024
  m.max_seq_len = 8192
  m.rope_theta = 100_000.0
  m.num_heads = 6
  m.q_lora_rank = 192
  m.kv_lora_rank = 96
  m.qk_nope_dim = 48
  m.qk_rope_dim = 16
  m.v_head_dim = 48
  m.index_heads = 4
  m.index_head_dim = 32
  m.index_topk = 256
  m.dsa_query_block = 128
  m.dsa_key_block = 256
  m.delta_qk_heads = 4
  m.delta_v_heads = 8
  m.delta_qk_dim = 48
  m.delta_v_dim = 48
  m.delta_chunk_size = 32
  m.num_experts = 32
  m.experts_per_token = 4
  m.expert_dim = 256
  m.router_groups = 4
  m.router_topk_groups = 2
  m.routed_scaling = 1.0
  m.vision.image_size = 32
  m.vision.patch_size = 4
  m.vision.width = 128
  m.vision.depth = 2
  m.vision.num_heads = 4
  m.vision.mlp_dim = 256
  m.image_token_id = 8191
  m.param_dtype = "float32"
  m.dtype = "bfloat16"
  m.remat = "none"
  m.scan_layers = False  # 8 layers compile in seconds unrolled


def _agent(m: ml_collections.ConfigDict) -> None:
  """Sized for agent episodes on 2 CPU cores: long context, small width, 8192 ids (its own tokenizer:
  `small`'s recipe with one digit per token, training/assets/README.md)."""
  _small(m)
  m.d_model = 128
  m.num_layers = 4  # DSA, Delta, DSA, Delta
  m.dense_ffn_dim = 384
  m.max_seq_len = 4096
  m.num_heads = 4
  m.q_lora_rank = 64
  m.kv_lora_rank = 32
  m.qk_nope_dim = 24
  m.qk_rope_dim = 8
  m.v_head_dim = 32
  m.index_heads = 2
  m.index_head_dim = 16
  # Agent prompts (tool schemas + the request) run to ~500 tokens: top-512 keeps every key
  # of a short episode, so an untrained indexer cannot hide the prompt from the model.
  m.index_topk = 512
  m.dsa_query_block = 64
  m.dsa_key_block = 512
  m.dsa_dense_len = 2048  # SFT/RL rows of 1024-2048 tokens: masked dense beats gathering 512 keys
  m.delta_qk_heads = 2
  m.delta_v_heads = 4
  m.delta_qk_dim = 32
  m.delta_v_dim = 32
  m.num_experts = 8
  m.experts_per_token = 2
  m.expert_dim = 128
  m.router_groups = 2
  m.router_topk_groups = 1
  m.vision.width = 64
  m.vision.depth = 1
  m.vision.num_heads = 2
  m.vision.mlp_dim = 128


def _tiny(m: ml_collections.ConfigDict) -> None:
  m.vocab_size = 331  # 256 bytes + 15 special tokens + 60 BPE merges (training/assets)
  m.d_model = 56
  m.num_layers = 4
  m.dsa_period = 2  # DSA, Delta, DSA, Delta
  m.num_dense_layers = 1
  m.dense_ffn_dim = 92
  m.scan_layers = False
  m.max_seq_len = 256
  m.rope_theta = 10_000.0
  m.num_heads = 3
  m.q_lora_rank = 38
  m.kv_lora_rank = 22
  m.qk_nope_dim = 10
  m.qk_rope_dim = 6
  m.v_head_dim = 14
  m.index_heads = 3
  m.index_head_dim = 12
  m.index_topk = 16
  m.dsa_query_block = 8
  m.dsa_key_block = 16
  m.delta_qk_heads = 2
  m.delta_v_heads = 4
  m.delta_qk_dim = 10
  m.delta_v_dim = 6
  m.delta_conv_size = 4
  m.delta_chunk_size = 8
  m.num_experts = 8
  m.experts_per_token = 2
  m.expert_dim = 26
  m.num_shared_experts = 1
  m.router_groups = 2
  m.router_topk_groups = 1
  m.routed_scaling = 1.0
  m.vision.image_size = 16
  m.vision.patch_size = 4
  m.vision.width = 20
  m.vision.depth = 2
  m.vision.num_heads = 2
  m.vision.mlp_dim = 34
  m.image_token_id = 330  # the tokenizer's <|image|>, its last id
  m.param_dtype = "float32"
  m.dtype = "float32"
  m.remat = "none"


def _tiny_sharded(m: ml_collections.ConfigDict) -> None:
  """`tiny` with every split dim divisible by 8-device meshes (sharding tests).

  2 layers (Gated DSA + dense FFN, Delta + MoE); heads, widths and vocab even
  so `tensor` = 2 divides them, d_model = 56 and 8 experts divisible by 8 for
  `fsdp` / `expert` = 8 (the vocabulary is padded by one id). capacity_factor
  8 >= any expert axis of 8 devices, so the capacity exchange never drops.
  """
  _tiny(m)
  m.vocab_size = 332  # tiny's tokenizer (331 ids) padded to an even size for tensor = 2
  m.num_layers = 2
  m.num_heads = 4
  m.index_heads = 4
  m.capacity_factor = 8.0


def _train() -> ml_collections.ConfigDict:
  """Optimisation (training/train_step.py): AdamW, warm-up + cosine, clipping, aux weights."""
  t = ml_collections.ConfigDict()
  t.steps = 100_000
  t.global_batch = 1024  # sequences per optimizer step
  t.seq_len = 4096
  t.learning_rate = 2.2e-4
  t.warmup_steps = 2000
  t.end_lr_fraction = 0.1  # cosine decays to this fraction of the peak
  t.weight_decay = 0.1  # matrices only (norms, biases, A_log, dt_bias excluded)
  t.b1 = 0.9
  t.b2 = 0.95
  t.eps = 1e-8
  t.grad_clip = 1.0  # global-norm clipping; 0 turns it off
  t.z_loss_weight = 1e-3  # router z-loss (ST-MoE)
  t.seq_aux_weight = 1e-4  # sequence-wise balance loss (DeepSeek-V3)
  t.indexer_loss_weight = 1.0  # DSA indexer KL; its gradient reaches only the indexer
  t.router_bias_rate = 1e-3  # aux-loss-free bias update per step
  t.grad_accum = 1  # micro-batches per optimizer step (global_batch must divide)
  t.nan_policy = "stop"  # non-finite loss/grads: "stop" (name the tensor) or "skip" the update
  # The optimizer, finiteness checks and gradient norm on same-role parameters of all layers
  # stacked (training/leaf_groups.py), for leaves of at most this many elements: compiles once
  # per role, not per layer (93-layer train step 217 -> 89 s); stacking is a copy, so larger
  # leaves stay per leaf. 0: everything per leaf.
  t.group_max_elements = 1 << 20
  return t


def _mesh() -> ml_collections.ConfigDict:
  """Device mesh (sharding/mesh.py): one size per axis, at most one -1 (fill)."""
  mesh = ml_collections.ConfigDict()
  mesh.data = 1
  mesh.fsdp = -1
  mesh.expert = 1
  mesh.tensor = 1
  return mesh


def get_config(arg: str = "tiny") -> ml_collections.ConfigDict:
  """Returns the config for variant `arg` (one of VARIANTS)."""
  if arg not in VARIANTS:
    raise ValueError(
        f"configs/horizon.py: unknown variant {arg!r}; choose one of {VARIANTS} "
        "(e.g. --config=configs/horizon.py:tiny).")
  config = ml_collections.ConfigDict()
  config.variant = arg
  config.seed = 0
  config.model = _full_model()
  config.mesh = _mesh()
  config.train = _train()
  if arg in ("tiny", "tiny_sharded", "small", "agent"):
    config.train.update(steps=200, global_batch=8, seq_len=64 if arg not in ("small", "agent") else 256,
                        learning_rate=3e-3 if arg not in ("small", "agent") else 1e-3, warmup_steps=10)
  {"small": _small, "agent": _agent, "tiny": _tiny, "tiny_sharded": _tiny_sharded}.get(
      arg, lambda m: None)(config.model)
  return config
