"""Mutation audit of the SFT source and its checks (rl/sft/source.py, rl/sft/checks.py): which tasks
an SFT run generates and plays, the tier chat files are rendered at, what the digest counts, and
the fields a resumed run is compared by. Each test names the mutants it catches."""

from __future__ import annotations

import json
import re

import pytest

from configs import sft as sft_config
from rl.sft import checks, source


@pytest.fixture(scope="module")
def parts():
  """A tiny SFT config, its tokenizer, renderer and train config."""
  from serving.chat import ChatRenderer
  from training import batches as batches_lib
  from training.train_step import TrainConfig
  config = sft_config.get_config("tiny")
  tok = batches_lib.tokenizer_for(config)
  return config, tok, ChatRenderer(tok, num_image_tokens=0), TrainConfig.from_config(config.train)


def _chat(tmp_path, *assistants):
  """A chat file with one conversation per assistant message (a dict merged into the reply)."""
  path = tmp_path / "chat.jsonl"
  convs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", **a}]
           for a in assistants]
  path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs))
  return path


def _batches(config, parts):
  _, tok, renderer, tc = parts
  return source.SFTBatches(config, None, tc, tok, renderer, ctx=None, loop=None)


def test_generated_tasks_are_the_train_split_at_task_seed_per_level(tmp_path, parts, monkeypatch):
  """Catches SFT generating heldout tasks (the evaluation's), seeding them with config.sft.seed
  (the example order) instead of task_seed, one tier-draw seed for every level of a domain, and the
  counts keyed by domain alone (level 1's count overwrote level 0's)."""
  config = parts[0].copy_and_resolve_references()
  chat = _chat(tmp_path, {})
  config.sft.update(domains="math,terminal", difficulties="1,0", tasks_per_level=3, task_seed=7, seed=5,
                    tiers="low=1", chat_files=str(chat))
  generated, played = [], []

  def generate(domain, **kw):
    generated.append((domain, kw))
    return [f"{domain}/{kw['difficulty']}"]

  def play(tasks, *args, **kw):
    played.append((tasks, kw["tiers"], kw["seed"]))
    return []

  monkeypatch.setattr(source.generators, "generate", generate)
  monkeypatch.setattr(source, "oracle_conversations", play)
  built = _batches(config, parts)
  assert generated == [("math", {"split": "train", "difficulty": 0, "n": 3, "seed": 7}),
                       ("math", {"split": "train", "difficulty": 1, "n": 3, "seed": 7}),
                       ("terminal", {"split": "train", "difficulty": 0, "n": 3, "seed": 7}),
                       ("terminal", {"split": "train", "difficulty": 1, "n": 3, "seed": 7})]
  assert [p[0] for p in played] == [["math/0"], ["math/1"], ["terminal/0"], ["terminal/1"]]
  assert all(p[1] == {"low": 1.0} for p in played)
  seeds = [p[2] for p in played]
  assert seeds[0] != seeds[1] and seeds[2] != seeds[3]  # each level draws its own tiers
  assert built.summary()["sft_sources"] == {"math/0": 0, "math/1": 0, "terminal/0": 0, "terminal/1": 0,
                                            str(chat): 1}
  other = config.copy_and_resolve_references()
  other.sft.task_seed = 8
  played.clear()
  _batches(other, parts)
  assert [p[2] for p in played] != seeds  # the draws follow task_seed


def _decoded_rows(config, parts):
  built = _batches(config, parts)
  tok = parts[1]
  return [tok.decode(r["inputs"].tolist()) for r in built.rows], built


def test_chat_files_are_rendered_at_the_stated_tier_or_max_when_they_think(tmp_path, parts):
  """Catches config.sft.chat_tier refused for 'low' (a tier the docs offer) and ignored by the source
  (every chat rendered as if it were '': 'max' where it thinks)."""
  config = parts[0].copy_and_resolve_references()
  chat = _chat(tmp_path, {"reasoning_content": "think it through"})
  config.sft.update(domains="", chat_files=str(chat))
  checks.check_sft_config(config)
  texts, built = _decoded_rows(config, parts)
  assert len(texts) == 1 and "Reasoning effort: max" in texts[0] and "think it through" in texts[0]
  for tier in ("low", "high", "max"):
    config.sft.chat_tier = tier
    checks.check_sft_config(config)
    texts, _ = _decoded_rows(config, parts)
    assert f"Reasoning effort: {tier}" in texts[0], tier
  plain = _chat(tmp_path, {})
  config.sft.update(chat_files=str(plain), chat_tier="")
  texts, built = _decoded_rows(config, parts)
  assert "Reasoning effort" not in texts[0] and built.summary()["sft_sources"] == {str(plain): 1}


def test_every_chat_conversation_is_trained_and_counted(tmp_path, parts):
  """Catches a chat file's count taken from all examples so far, and conversations of a file left out."""
  config = parts[0].copy_and_resolve_references()
  first = _chat(tmp_path, {}, {}, {})
  second = tmp_path / "second.jsonl"
  second.write_text(json.dumps({"messages": [{"role": "user", "content": "a"},
                                             {"role": "assistant", "content": "b"}]}) + "\n")
  config.sft.update(domains="", chat_files=f"{first},{second}")
  summary = _batches(config, parts).summary()
  assert summary["sft_sources"] == {str(first): 3, str(second): 1} and summary["sft_examples"] == 4


def _identity_state(config):
  return {"pipeline": "sft", "seed": 0, "rows": 1, "data": dict(checks.data_identity(config))}


@pytest.mark.parametrize("field,value,message", [
    ("serving.thinking_budgets.low", 7, "config.serving.thinking_budgets.low (checkpoint "),
    ("env.max_turns", 3, "config.env.max_turns (checkpoint 8, now 3)"),
    ("env.system_prompt", "Be brief.", "config.env.system_prompt (checkpoint '', now 'Be brief.')"),
    ("data.tokenizer", "/x/tok.json", "config.data.tokenizer (checkpoint '', now '/x/tok.json')"),
])
def test_a_resume_with_other_limits_prompt_budgets_or_tokenizer_is_refused(parts, field, value, message):
  """Catches each knob outside config.sft that shapes the examples dropped from the data identity
  (a resume with another system prompt or thinking budget trained on silently)."""
  config = parts[0].copy_and_resolve_references()
  state = _identity_state(config)
  section, _, key = field.rpartition(".")
  holder = config
  for name in section.split("."):
    holder = holder[name]
  holder[key] = value
  with pytest.raises(ValueError, match=re.escape(message)):
    source.SFTBatches.check_state(config, state)


def test_a_field_only_one_version_knows_is_not_compared(parts):
  """Catches the union of the stored and current fields compared (a KeyError on a checkpoint from a
  version with a field this one dropped, or without one it added), instead of the shared ones."""
  config = parts[0].copy_and_resolve_references()
  state = _identity_state(config)
  del state["data"]["env.system_prompt"]
  state["data"]["sft.retired_knob"] = 1
  source.SFTBatches.check_state(config, state)
  config.sft.task_seed = 3  # a shared field still compared
  with pytest.raises(ValueError, match=re.escape("config.sft.task_seed (checkpoint 0, now 3). Resume")):
    source.SFTBatches.check_state(config, state)


def test_the_digest_counts_each_examples_source():
  """Catches the example's source (a task id, a chat file:line) left out of the digest: the same
  trained tokens under another task id resumed as the same data."""
  import numpy as np

  from rl.sft import data as sft

  def digest(source_name, **kw):
    d = checks.DataDigest()
    ids, mask = np.array([5, 6, 7], np.int32), np.array([0, 1, 1], np.int32)
    d.add(sft.Example(ids, mask, source=source_name), **kw)
    return d.hexdigest()

  assert digest("math-train-d0-s0-00000", tier="low") == digest("math-train-d0-s0-00000", tier="low")
  assert digest("math-train-d0-s0-00000", tier="low") != digest("math-train-d0-s0-00001", tier="low")
  assert digest("a.jsonl:1", whole=True) != digest("a.jsonl:2", whole=True)


def _oracle_build(config, parts, monkeypatch, tiers):
  """SFTBatches over one math level whose 'oracles' are the one answer 'a' to 'q', at `tiers`."""
  from serving.types import Message, TextPart

  class Task:
    def __init__(self, i):
      self.id = f"t{i}"

  def play(tasks, *args, **kw):
    return [([Message("user", [TextPart("q")]), Message("assistant", [TextPart("a")])], [], tier, Task(i))
            for i, tier in enumerate(tiers)]

  monkeypatch.setattr(source.generators, "generate", lambda *a, **k: [])
  monkeypatch.setattr(source, "oracle_conversations", play)
  return _batches(config, parts)


def test_the_digest_counts_each_oracle_examples_tier_and_the_tiers_are_counted(parts, monkeypatch):
  """Catches an oracle example's tier left out of the digest (the same answers rendered at another
  effort resumed as the same data) and the per-tier counts of the summary."""
  config = parts[0].copy_and_resolve_references()
  config.sft.update(domains="math", difficulties="0")
  low = _oracle_build(config, parts, monkeypatch, ["low", "low", None])
  high = _oracle_build(config, parts, monkeypatch, ["high", "low", None])
  assert low.summary()["sft_tiers"] == {"low": 2, "off": 1}
  assert high.summary()["sft_tiers"] == {"high": 1, "low": 1, "off": 1}
  assert low.summary()["sft_sources"] == {"math/0": 3}
  assert low.digest == _oracle_build(config, parts, monkeypatch, ["low", "low", None]).digest != high.digest


def test_no_rows_is_an_error_naming_the_counts(tmp_path, parts, monkeypatch):
  """Catches the no-rows check dropped: every example longer than seq_len (or no oracle succeeding)
  built a source that failed only at the first batch, without the counts."""
  config = parts[0].copy_and_resolve_references()
  config.sft.update(domains="math", difficulties="0")
  with pytest.raises(ValueError, match=re.escape("config.sft gave no training rows: set sft.domains and/or "
                                                 "sft.chat_files (counts: {'math/0': 0}, dropped as longer")):
    _oracle_build(config, parts, monkeypatch, [])
  from training.train_step import TrainConfig
  chat = _chat(tmp_path, {"content": "word " * 40})
  config.sft.update(domains="", chat_files=str(chat))
  config.train.seq_len = 16
  _, tok, renderer, _ = parts
  with pytest.raises(ValueError, match=re.escape(f"(counts: {{'{chat}': 1}}, dropped as longer than "
                                                 "seq_len=16: 1)")):
    source.SFTBatches(config, None, TrainConfig.from_config(config.train), tok, renderer, ctx=None, loop=None)


def test_an_old_state_with_another_seed_is_refused(tmp_path, parts):
  """Catches set_state comparing the row count only: a checkpoint written before the data identity
  was stored, with another config.sft.seed (another example order), resumed silently."""
  config = parts[0].copy_and_resolve_references()
  config.sft.update(domains="", chat_files=str(_chat(tmp_path, {})))
  built = _batches(config, parts)
  built.set_state({"pipeline": "sft", "seed": 0, "rows": 1})
  message = "the checkpoint's SFT data had seed 3 and 1 rows, this run 0 and 1: resume with the same"
  with pytest.raises(ValueError, match=re.escape(message)):
    built.set_state({"pipeline": "sft", "seed": 3, "rows": 1})


def test_each_step_takes_its_own_permutation_of_the_rows(tmp_path, parts):
  """Catches batch(step) ignoring the step (every step trained on the same batch): with as many
  rows as the batch, every step's batch holds each row once, in an order of its own."""
  import jax
  import numpy as np

  from sharding import mesh as mesh_lib
  from training.train_step import TrainConfig
  config = parts[0].copy_and_resolve_references()
  config.sft.update(domains="", chat_files=str(_chat(tmp_path, {})))
  config.train.global_batch = 8
  tc = TrainConfig.from_config(config.train)
  _, tok, renderer, _ = parts
  mesh = mesh_lib.make_mesh({"data": 8, "fsdp": 1, "expert": 1, "tensor": 1})
  built = source.SFTBatches(config, mesh, tc, tok, renderer, ctx=None, loop=None)
  built.rows = [{"inputs": np.full(tc.seq_len, i, np.int32)} for i in range(8)]
  order = [np.asarray(jax.device_get(built.batch(step)["inputs"]))[:, 0].tolist() for step in range(3)]
  assert all(sorted(o) == list(range(8)) for o in order)
  assert order[0] != order[1] != order[2] != order[0]


def test_an_oracle_is_played_and_trained_with_its_tasks_tools(parts):
  """Catches the tools an episode offered not recorded (a web oracle's tool calls trained without
  the tool declarations in its prompt)."""
  from rl.agent.loop import LoopConfig
  from rl.envs.base import EnvContext
  from rl.sft import data as sft
  from rl.tasks.generators import web
  _, tok, renderer, _ = parts
  tasks = web.generate(split="train", difficulty=0, n=1, seed=0)
  played = source.oracle_conversations(tasks, EnvContext(), LoopConfig(default_max_turns=8),
                                       {"low": 4096, "high": 4096, "max": 4096}, tok, workers=1)
  [(messages, tools, _, task)] = played
  assert task.id == tasks[0].id and [t.name for t in tools] == ["search", "open", "find"]
  assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
  text = tok.decode(sft.render_example(renderer, messages, tools, "max").ids.tolist())
  assert "# Tools" in text  # the declarations the model saw when it made the calls
