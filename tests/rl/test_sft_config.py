"""config.sft: every knob checked before an oracle plays, tier 'off' honoured, and a resumed run's
data compared with its checkpoint's before the data is built again."""

from __future__ import annotations

import json
import re

import pytest

from configs import sft as sft_config
from rl.sft import data as sft
from rl.sft import source


@pytest.fixture
def no_play(monkeypatch):
  """Records any task generation or oracle episode (none may happen before the checks)."""
  played = []
  monkeypatch.setattr(source.generators, "generate", lambda *a, **k: played.append(("generate", a, k)))
  monkeypatch.setattr(source, "oracle_conversations", lambda *a, **k: played.append(("play", a, k)))
  return played


@pytest.mark.parametrize("changes,message", [
    ({"difficulties": "9"}, "config.sft.difficulties='9': level 9 is outside math's levels 0..4"),
    ({"domains": "math,terminal", "difficulties": "0,4"},
     "config.sft.difficulties='0,4': level 4 is outside terminal's levels 0..3"),
    ({"difficulties": "x"}, "config.sft.difficulties='x': 'x' is not an integer level"),
    ({"difficulties": "-1"}, "config.sft.difficulties='-1': level -1 is outside math's levels 0..4"),
    ({"difficulties": "0,0"}, "config.sft.difficulties='0,0': '0' appears twice"),
    ({"difficulties": " "}, "config.sft.difficulties=' ' is empty"),
    ({"seed": -1}, "config.sft.seed=-1: must be an int >= 0"),
    ({"task_seed": -1}, "config.sft.task_seed=-1: must be an int >= 0"),
    ({"tasks_per_level": 0}, "config.sft.tasks_per_level=0: must be an int >= 1"),
    ({"domains": "math,math"}, "config.sft.domains='math,math': 'math' appears twice"),
    ({"domains": "math,bogus"}, "config.sft.domains: unknown domain 'bogus'"),
    ({"tiers": "low=1,low=2"}, "config.sft.tiers='low=1,low=2': tier 'low' appears twice"),
    ({"tiers": "medium"}, "config.sft.tiers: unknown tier 'medium'"),
    ({"chat_files": "a.jsonl,a.jsonl"}, "config.sft.chat_files='a.jsonl,a.jsonl': 'a.jsonl' appears twice"),
    ({"chat_files": "a.jsonl", "chat_tier": "off"}, "config.sft.chat_tier='off': give one of low, high, max"),
    ({"chat_tier": "high"}, "config.sft.chat_tier='high' states the tier of chat files, but "
                            "config.sft.chat_files is empty"),
    ({"domains": "", "chat_files": "a.jsonl", "tiers": "low"}, "config.sft.tiers='low' draws tiers for"),
    ({"domains": ""}, "config.sft.domains and config.sft.chat_files are both empty"),
])
def test_sft_knobs_are_checked_before_any_task_is_played(no_play, changes, message):
  """A level past the domain's top was clamped, a repeated domain trained twice (counted once),
  seed=-1 failed after every oracle had played, 'x' / 0 failed without naming the field."""
  config = sft_config.get_config("tiny")
  config.sft.update(changes)
  with pytest.raises(ValueError, match=re.escape(message)):
    source.SFTBatches(config, mesh=None, tc=None, tokenizer=None, renderer=None, ctx=None, loop=None)
  assert not no_play


def test_the_launcher_checks_config_sft_first(tmp_path, no_play, monkeypatch):
  from rl.sft import train
  monkeypatch.setattr(train.loop, "run", lambda *a, **k: pytest.fail("the loop started"))
  config = sft_config.get_config("tiny")
  config.sft.difficulties = "9"
  with pytest.raises(ValueError, match=re.escape("level 9 is outside math's levels 0..4")):
    train.run_sft(config, str(tmp_path / "w"))
  assert not no_play and not (tmp_path / "w").exists()


@pytest.fixture(scope="module")
def tiny():
  """A tiny config with 6 math tasks, its tokenizer, renderer and train config."""
  from serving.chat import ChatRenderer
  from training import batches as batches_lib
  from training.train_step import TrainConfig
  config = sft_config.get_config("tiny")
  config.sft.tasks_per_level = 6
  config.env.workers = 2
  tok = batches_lib.tokenizer_for(config)
  return config, tok, ChatRenderer(tok, num_image_tokens=0), TrainConfig.from_config(config.train)


def _build(config, tiny_parts):
  from rl.agent.loop import LoopConfig
  from rl.envs.base import EnvContext
  _, tok, renderer, tc = tiny_parts
  return source.SFTBatches(config, None, tc, tok, renderer, EnvContext.from_config(config.env),
                           LoopConfig.from_config(config.env))


def test_tier_off_plays_and_renders_thinking_off(tiny):
  """'off' passed parse_tier_mix and then trained thinking anyway (every task at 'max')."""
  from rl.agent.loop import LoopConfig
  from rl.envs.base import EnvContext
  from rl.tasks.generators import math as gen
  config, tok, renderer, _ = tiny
  budgets = dict(config.serving.thinking_budgets)
  tasks = gen.generate(split="train", difficulty=0, n=6)
  played = source.oracle_conversations(tasks, EnvContext(), LoopConfig(default_max_turns=1), budgets, tok,
                                       workers=2, tiers=sft.parse_tier_mix("off"), seed=0)
  assert len(played) == len(tasks)  # the oracle still answers correctly without its thinking
  for messages, tools, tier, _ in played:
    assert tier is None and all(m.thinking is None for m in messages if m.role == "assistant")
    ex = sft.render_example(renderer, messages, tools, tier)
    prompt = renderer.render(messages[:-1], tools=tools, thinking=False).ids
    assert ex.ids.tolist()[:len(prompt)] == prompt  # the thinking-off generation prompt
    assert "Reasoning effort" not in tok.decode(ex.ids.tolist())
  mixed = config.copy_and_resolve_references()
  mixed.sft.tiers = "off=1,high=1"
  summary = _build(mixed, tiny).summary()
  # (a drawn 'high' whose thinking the tiny budgets cannot hold falls back to a tier that does)
  assert "off" in summary["sft_tiers"] and sum(summary["sft_tiers"].values()) == 6
  assert 0 < summary["sft_tiers"]["off"] < 6


def test_every_process_trains_on_process_0s_rows(tiny, monkeypatch):
  """The code oracle's tool results carry unittest's run time, which tokenizes to different
  lengths on different processes, and each process packed its own rows: a multi-process SFT's
  processes built different global batches. Process 1 now takes process 0's rows."""
  import jax
  mine = _build(tiny[0], tiny).rows
  sent = []

  def gather(objs):  # what process 0 sent, then this process's own (empty) list
    sent.append(objs)
    return [mine[::-1], list(objs)]

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  monkeypatch.setattr(source, "gather_objects", gather)
  rows = _build(tiny[0], tiny).rows
  assert sent == [[]] and len(rows) == len(mine) > 1
  assert all((a[k] == b[k]).all() for a, b in zip(rows, mine[::-1], strict=True) for k in a)


def _checkpoint(run_dir, config, data_state, step=2):
  from flax import nnx

  from model.config import ModelConfig
  from model.decoder import Horizon
  from training.checkpoint import Checkpointer
  model = Horizon(ModelConfig.from_config(config.model), rngs=nnx.Rngs(0))
  ck = Checkpointer(str(run_dir / "checkpoints"), every=1, keep=1, async_save=False)
  ck.save(step, model=model, data_state=data_state, config=config.to_dict(), force=True)
  ck.wait()
  ck.close()


def test_a_resume_on_other_sft_data_is_refused_before_the_data_is_built(tmp_path, tiny, monkeypatch):
  """The data state was (seed, row count): another task_seed whose tasks packed into as many rows
  trained on silently; other changes were caught only after every oracle had played again."""
  from rl.sft import checks, train
  config = tiny[0].copy_and_resolve_references()
  config.train.global_batch = 8  # the 8 test devices divide it
  built = _build(config, tiny)
  state = json.loads(json.dumps(built.get_state()))  # as the checkpoint stores it
  source.SFTBatches.check_state(config, state)
  built.set_state(state)
  other = config.copy_and_resolve_references()
  other.sft.task_seed = 11
  other.train.seq_len = 128
  differs = ("whose data came from another config: config.sft.task_seed (checkpoint 0, now 11); "
             "config.train.seq_len (checkpoint 256, now 128).")
  with pytest.raises(ValueError, match=re.escape(differs)):
    source.SFTBatches.check_state(other, state)
  # Through the launcher: refused after the loop's own checks, before any oracle plays again.
  run_dir = tmp_path / "run"
  _checkpoint(run_dir, config, state)
  played = []
  monkeypatch.setattr(source, "oracle_conversations", lambda *a, **k: played.append(a))
  other.train.seq_len = 256
  with pytest.raises(ValueError, match=re.escape("config.sft.task_seed (checkpoint 0, now 11). Resume with")):
    train.run_sft(other, str(run_dir))
  assert not played
  # Data that differs though the config is the same (a chat file edited): refused by the digest.
  chats = config.copy_and_resolve_references()
  path = tmp_path / "chat.jsonl"
  chats.sft.update(domains="", chat_files=str(path))

  def chat_state(answer):
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer}]
    path.write_text(json.dumps({"messages": conv}) + "\n")
    return _build(chats, tiny)

  first = json.loads(json.dumps(chat_state("hello").get_state()))
  chat_state("hello").set_state(first)  # the same file: the same digest
  edited = chat_state("howdy")
  source.SFTBatches.check_state(chats, first)  # the config is the same ...
  with pytest.raises(ValueError, match="the SFT data built now differs from the data of the checkpoint"):
    edited.set_state(first)  # ... the data is not
  # A checkpoint written before the identity was stored resumes as before: seed and rows compared.
  old = {"pipeline": "sft", "seed": state["seed"], "rows": state["rows"]}
  source.SFTBatches.check_state(other, old)
  built.set_state(old)
  with pytest.raises(ValueError, match=re.escape("resume with the same config.sft")):
    built.set_state(dict(old, rows=old["rows"] + 1))
  with pytest.raises(ValueError, match=re.escape(checks.NOT_SFT)):
    source.SFTBatches.check_state(config, {"pipeline": "bytes"})
