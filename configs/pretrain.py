"""Pretraining configs: configs/horizon.py (model, mesh, train) plus data, checkpoints, metrics.

    python -m experiments.pretrain --config=configs/pretrain.py:tiny --workdir=/tmp/horizon_tiny
    python -m experiments.pretrain --config=configs/pretrain.py:small --workdir=gs://bucket/run \
        --config.train.steps=20000 --config.mesh.fsdp=-1
    # 8 fake CPU devices, 2-way data x 4-way expert, raw-byte data (no tokenizer, no preparation):
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.pretrain \
        --config=configs/pretrain.py:tiny_sharded --workdir=/tmp/horizon_mesh \
        --config.data.pipeline=bytes --config.mesh.data=2 --config.mesh.fsdp=1 --config.mesh.expert=4

Every default lives here or in configs/horizon.py, once.
"""

import ml_collections

from configs import horizon

VARIANTS = horizon.VARIANTS


def _data() -> ml_collections.ConfigDict:
  d = ml_collections.ConfigDict()
  # Where batches come from (training/batches.py): "grain" = the sources below,
  # tokenized into shards and read by the grain pipeline; "bytes" = the
  # standard library's source as raw bytes (ids 0..255), addressed by
  # (shuffle_seed, step, row), so any number of processes builds the same
  # global batch (the multi-host test relies on it).
  d.pipeline = "grain"
  # tokenizer.json / tiktoken file; "" = the bundled one for the variant
  # (training/assets/tokenizer_<tiny|small>.json; `full` needs a path).
  d.tokenizer = ""
  # "kind[:glob[@field]]=weight;..." kinds stdlib | text | jsonl, e.g.
  # "stdlib=0.8;jsonl:/data/web/*.jsonl@text=0.2" (a weight is the source's share
  # of the training tokens, relative to the others). The default is the Python
  # standard library of the running interpreter: present everywhere.
  d.sources = "stdlib=1.0"
  d.prepared_dir = ""  # ArrayRecord shards + manifest; "" = <workdir>/data
  d.max_docs = 0  # per source, 0 = all (a cap for smoke runs)
  d.shuffle_seed = 0  # grain: shuffling and mixing; bytes: the window offsets
  d.packing = "concat"  # "concat" (no padding) | "first_fit" (whole documents, padded)
  return d


def _checkpoint() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.every = 1000  # optimizer steps between (asynchronous) saves
  c.keep = 3  # newest checkpoints kept
  c.async_save = True
  # A fresh run (no checkpoint in its workdir yet) starts from these weights (a checkpoint
  # directory, e.g. pretraining's for SFT); the optimizer, step and data start anew. "" = random.
  c.init_from = ""
  return c


def _metrics() -> ml_collections.ConfigDict:
  m = ml_collections.ConfigDict()
  m.log_every = 10
  # Peak FLOP/s per device for MFU; 0 = known accelerator table, or measured
  # with a bf16 x bf16 -> f32 matmul at start-up on CPU.
  m.peak_flops = 0.0
  m.tensorboard = True
  return m


def get_config(arg: str = "tiny") -> ml_collections.ConfigDict:
  config = horizon.get_config(arg)
  config.data = _data()
  config.checkpoint = _checkpoint()
  config.metrics = _metrics()
  if arg in ("tiny", "tiny_sharded"):
    config.train.update(steps=300, global_batch=16, seq_len=128, learning_rate=3e-3, warmup_steps=20)
    config.checkpoint.every = 100
    config.metrics.log_every = 10
  elif arg == "small":
    config.train.update(steps=2000, global_batch=16, seq_len=256, learning_rate=1e-3, warmup_steps=100)
    config.checkpoint.every = 200
  return config
