"""Supervised warm start (SFT) and agent evaluation: model, serving, environments, SFT data.

    python -m experiments.sft --config=configs/sft.py:agent --workdir=/tmp/horizon_sft
    python -m experiments.sft --config=configs/sft.py:agent --workdir=/tmp/sft2 \
        --config.checkpoint.init_from=/tmp/horizon_agent_pretrain/checkpoints \
        --config.sft.chat_files=/data/chats.jsonl --config.sft.domains=''
    python -m experiments.evaluate --config=configs/sft.py:agent --checkpoint=/tmp/horizon_sft/checkpoints \
        --domains=math,terminal --split=heldout --n=100 --out=/tmp/eval_sft

Builds on configs/pretrain.py (model, mesh, train, data.tokenizer, checkpoint, metrics) and
configs/serve.py (the engine the evaluation and RL rollouts run on). `env` holds what
episodes need (sandbox limits, executor, turn and token limits), `sft` the training data:
oracle trajectories of generated `train`-split tasks (played through the real environments)
and/or OpenAI-format chat JSONL files. Every default lives here, once.
"""

import ml_collections

from configs import pretrain, serve

VARIANTS = pretrain.VARIANTS


def env() -> ml_collections.ConfigDict:
  """Episodes: where environments run and their limits (rl/envs/base.py, rl/agent/loop.py)."""
  e = ml_collections.ConfigDict()
  e.executor = "thread"  # "thread" (in process) | "ray" (Ray actors; pip install 'ray')
  e.workers = 8  # environment worker threads (thread executor)
  e.root = ""  # parent of task directories; "" = a fresh temp dir
  e.allow_unsafe_sandbox = False  # run commands without nsjail when it cannot start (never silently)
  e.command_timeout_s = 20.0  # one shell tool call
  e.memory_mb = 512  # cgroup memory limit of one sandboxed command
  e.max_pids = 64  # cgroup pids limit of one sandboxed command
  e.output_limit_bytes = 65536  # stdout + stderr kept from one command
  e.disk_mb = 256  # size cap of one episode's task directory (a tmpfs where root may mount one)
  e.max_turns = 8  # assistant messages per episode when the task sets none
  e.max_tokens_per_turn = 256  # generated tokens per assistant message (thinking included)
  e.system_prompt = ""  # an optional system message before the task's first user message
  e.seed = 0  # sampling seeds of episodes (sample i of a task: seed + i)
  return e


def _sft() -> ml_collections.ConfigDict:
  s = ml_collections.ConfigDict()
  s.domains = "math,terminal"  # generated tasks whose oracles are trained on; "" = none
  s.difficulties = "0"  # levels per domain: "0", "0,1", or "all"
  s.tasks_per_level = 1500  # train-split tasks per domain and level
  # "" = each oracle at the smallest tier holding its thinking; "low=1,high=1,max=1" = a tier
  # drawn per task, thinking as deep as the oracle writes for it (thinking_by_tier); "off" = the
  # oracle's turns without thinking, rendered with thinking off
  s.tiers = ""
  s.task_seed = 0
  s.chat_files = ""  # comma-separated OpenAI-format chat JSONL files
  s.chat_tier = ""  # low | high | max stated for chat files; "" = "max" when they think, else thinking off
  s.seed = 0  # example order and batch sampling
  return s


def get_config(variant: str = "agent") -> ml_collections.ConfigDict:
  config = pretrain.get_config(variant)
  config.serving = serve.get_config(variant).serving
  # Evaluation and RL rollouts: a task's episode must not depend on what else the engine runs.
  config.serving.batch_invariant = True
  config.env = env()
  config.sft = _sft()
  config.train.update(steps=200, global_batch=8, seq_len=1024, learning_rate=2e-3, warmup_steps=20)
  config.checkpoint.every = 100
  config.metrics.log_every = 20
  if variant == "agent":  # room for the max tier's 512 thinking tokens and an answer
    config.env.max_tokens_per_turn = 640
  if variant in ("tiny", "tiny_sharded"):  # tests: a 256-token model, short data
    config.train.update(steps=20, global_batch=4, seq_len=256, learning_rate=3e-3, warmup_steps=2)
    config.sft.tasks_per_level = 16
    config.sft.domains = "math"  # tool prompts (tool schemas in the system part) exceed 256 tokens
    config.env.max_tokens_per_turn = 48
    config.checkpoint.every = 10
    config.metrics.log_every = 5
  return config
