"""SFT data: assistant-only masks, OpenAI chat JSONL, packing that no segment crosses."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl.sft import data as sft
from serving.chat import ChatRenderer
from serving.types import Message, TextPart, Tool, ToolCall
from training.tokenizer import default_tokenizer_path, load_tokenizer

TOOL = Tool(
  "shell",
  "Run a command.",
  {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
)


@pytest.fixture(scope="module")
def renderer():
  return ChatRenderer(load_tokenizer(default_tokenizer_path("tiny")), num_image_tokens=0)


def _conversation():
  call = ToolCall("call_0", "shell", json.dumps({"command": "ls"}))
  return [
    Message("system", [TextPart("sys")]),
    Message("user", [TextPart("list files")]),
    Message("assistant", [TextPart("")], thinking="use ls", tool_calls=[call]),
    Message("tool", [TextPart("a.txt")], tool_call_id="call_0", name="shell"),
    Message("assistant", [TextPart("<answer>a.txt</answer>")], thinking="done"),
  ]


def test_mask_covers_exactly_the_assistant_turns(renderer):
  tok = renderer.tokenizer
  msgs = _conversation()
  ex = sft.render_example(renderer, msgs, [TOOL], tier="low")
  sp = {n: tok.special_id(n) for n in ("assistant", "think", "/think", "end_of_turn", "tool_call", "tool")}
  ids, mask = ex.ids.tolist(), ex.mask.tolist()
  assert (
    ids == renderer.render(msgs, tools=[TOOL], effort="low", thinking=True, add_generation_prompt=False).ids
  )
  trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m and t not in tok.special_ids])
  assert "use ls" in trained and "a.txt</answer>" in trained and '"command": "ls"' in trained
  assert "list files" not in trained and "sys" not in trained
  # the generation prompt (<|assistant|><|think|>) is not trained; what follows it is, up to <|end_of_turn|>
  for i, t in enumerate(ids):
    if t == sp["assistant"]:
      assert mask[i] == 0 and mask[i + 1] == 0 and mask[i + 2] == 1
  ends = [i for i, t in enumerate(ids) if t == sp["end_of_turn"]]
  assert [mask[i] for i in ends] == [0, 0, 1, 0, 1]  # system, user, assistant, tool, assistant
  tool_start = ids.index(sp["tool"])
  assert mask[tool_start] == 0 and sum(mask[tool_start : ends[3] + 1]) == 0


def test_chat_jsonl_round_trip_and_errors(tmp_path, renderer):
  good = {
    "messages": [
      {"role": "user", "content": "hi"},
      {
        "role": "assistant",
        "content": "",
        "reasoning_content": "think",
        "tool_calls": [
          {"id": "c1", "type": "function", "function": {"name": "shell", "arguments": '{"command": "ls"}'}}
        ],
      },
      {"role": "tool", "tool_call_id": "c1", "content": "x"},
      {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
    ],
    "tools": [{"type": "function", "function": {"name": "shell", "parameters": TOOL.parameters}}],
  }
  path = tmp_path / "chat.jsonl"
  bad_args = json.loads(json.dumps(good))
  bad_args["messages"][1]["tool_calls"][0]["function"]["arguments"] = "[1]"
  path.write_text(
    "\n".join(json.dumps(o) for o in (good, {"messages": [{"role": "user", "content": "q"}]}, bad_args))
    + "\n"
  )
  it = sft.load_chat_jsonl(path)
  messages, tools, untrained, where = next(it)
  assert untrained == frozenset()
  assert where.endswith(":1") and tools[0].name == "shell" and messages[1].thinking == "think"
  ex = sft.render_example(renderer, messages, tools, tier="high")
  assert ex.mask.sum() > 0
  with pytest.raises(sft.ChatDataError, match=r"chat.jsonl:2: field 'messages': has no assistant"):
    next(it)
  with pytest.raises(sft.ChatDataError, match=r"chat.jsonl:3: field 'messages\[1\].tool_calls\[0\]"):
    list(sft.load_chat_jsonl(tmp_path / "x.jsonl")) if False else sft.parse_chat(bad_args, f"{path}:3")


def test_tier_for_thinking():
  budgets = {"low": 8, "high": 32, "max": 96}
  assert sft.tier_for_thinking(0, budgets) == "low"
  assert sft.tier_for_thinking(9, budgets) == "high"
  assert sft.tier_for_thinking(500, budgets) == "max"


def _examples(rng, lengths):
  return [
    sft.Example(rng.integers(3, 300, n).astype(np.int32), (rng.random(n) < 0.6).astype(np.int32))
    for n in lengths
  ]


def test_pack_layout():
  rng = np.random.default_rng(0)
  exs = _examples(rng, [5, 7, 30, 6])
  stats = sft.PackStats()
  rows = list(sft.pack(exs, seq_len=15, stats=stats))
  assert stats.dropped_too_long == 1 and stats.examples == 4 and stats.rows == 2
  r = rows[0]
  assert r["segment_ids"].tolist() == [1] * 5 + [2] * 7 + [0] * 3
  assert r["positions"].tolist()[:12] == list(range(5)) + list(range(7))
  np.testing.assert_array_equal(r["targets"][:4], exs[0].ids[1:])
  # no target crosses a segment boundary or lands in padding; masks follow the target token
  assert r["loss_mask"][4] == 0 and r["loss_mask"][11:].sum() == 0
  np.testing.assert_array_equal(r["loss_mask"][:4], exs[0].mask[1:])
  b0 = sft.batches(rows, 3, seed=1, step=0)
  assert b0["inputs"].shape == (3, 15)
  np.testing.assert_array_equal(
    sft.batches(rows, 3, seed=1, step=5)["inputs"], sft.batches(rows, 3, seed=1, step=5)["inputs"]
  )


def test_packed_segments_do_not_see_each_other(tiny_cfg):
  """Logits of a conversation are the same packed beside others as alone: attention (DSA)
  and the delta rule's state and causal conv all stop at segment boundaries."""
  from model.decoder import build_model

  model = build_model(tiny_cfg, seed=0)
  rng = np.random.default_rng(7)
  exs = _examples(rng, [37, 23, 41])
  (row,) = list(sft.pack(exs, seq_len=128))
  forward = nnx.jit(lambda m, *rows: m(*rows))  # one compiled shape for all four calls; eager is slow
  packed, _ = forward(
    model,
    jnp.asarray(row["inputs"])[None],
    jnp.asarray(row["positions"])[None],
    jnp.asarray(row["segment_ids"])[None],
  )
  start, width = 0, row["inputs"].shape[0]
  for ex in exs:
    n = len(ex.ids)  # alone: at the start of a row of the same width (one compiled shape), causal
    ids = np.zeros(width, np.int32)
    ids[:n] = ex.ids
    seg = (np.arange(width) < n).astype(np.int32)
    alone, _ = forward(
      model, jnp.asarray(ids)[None], jnp.asarray(np.arange(width) * seg)[None], jnp.asarray(seg)[None]
    )
    np.testing.assert_allclose(
      np.asarray(packed[0, start : start + n]), np.asarray(alone[0, :n]), rtol=2e-5, atol=2e-5
    )
    start += n


def test_oracles_think_as_deep_as_the_drawn_tier(renderer):
  """config.sft.tiers: a tier per task; math's oracle writes the result alone at low, the working
  at high, the working with every column counted unit by unit at max; a drawn tier too small
  for its thinking falls back."""
  from rl.agent.loop import LoopConfig
  from rl.envs.base import EnvContext
  from rl.sft.source import oracle_conversations
  from rl.tasks.generators import math as gen

  tok = renderer.tokenizer
  budgets = {"low": 32, "high": 128, "max": 512}
  tasks = gen.generate(split="train", difficulty=0, n=24)
  played = oracle_conversations(tasks, EnvContext(), LoopConfig(default_max_turns=1), budgets, tok, workers=2,
                                tiers=sft.parse_tier_mix("low=1,high=1,max=1"), seed=3)
  assert len(played) == len(tasks)  # every tier's oracle still answers correctly
  lengths: dict[str, list[int]] = {}
  checks = 0
  for messages, _, tier, task in played:
    thinking = messages[-1].thinking
    # the tier's own thinking, or (a drawn tier too small for its thinking) the default thinking at
    # the smallest tier that holds it
    assert thinking in (task.oracle[0]["thinking_by_tier"][tier], task.oracle[0]["thinking"])
    assert thinking.endswith(f"So the answer is {task['answer']}.")
    checks += tier == "max" and ("count up from" in thinking or "count down from" in thinking)
    n = len(tok.encode(thinking, allow_special=False))
    assert n <= budgets[tier], (tier, n)
    lengths.setdefault(tier, []).append(n)
  assert set(lengths) == {"low", "high", "max"} and checks >= 2
  assert max(lengths["low"]) < np.mean(lengths["high"]) < np.mean(lengths["max"])
  # a budget the low thinking cannot fit: the smallest tier holding the default thinking instead
  small = {"low": 2, "high": 128, "max": 512}
  tight = oracle_conversations(tasks[:4], EnvContext(), LoopConfig(default_max_turns=1), small, tok,
                               workers=2, tiers={"low": 1.0}, seed=3)
  fits = [sft.tier_for_thinking(len(tok.encode(t.oracle[0]["thinking"], allow_special=False)), small)
          for t in tasks[:4]]
  assert [tier for _, _, tier, _ in tight] == fits and "low" not in fits
  # ... with the oracle's one default thinking, not that tier's (max's would be longer)
  assert [m[-1].thinking for m, _, _, _ in tight] == [t.oracle[0]["thinking"] for t in tasks[:4]]
  # without a tier mix likewise: the default thinking at the smallest tier that holds it
  default = oracle_conversations(tasks[:4], EnvContext(), LoopConfig(default_max_turns=1),
                                 {"low": 2, "max": 96}, tok, workers=2)
  assert [m[-1].thinking for m, _, _, _ in default] == [t.oracle[0]["thinking"] for t in tasks[:4]]
  with pytest.raises(ValueError, match="config.sft.tiers: unknown tier 'medium'"):
    sft.parse_tier_mix("medium", "config.sft.tiers")


def test_sft_domains_are_checked_before_any_is_played():
  from configs import sft as sft_config
  from rl.sft.source import SFTBatches
  config = sft_config.get_config("tiny")
  config.sft.domains = "math,bogus"
  # Nothing else is needed: the check runs before the first domain's oracles would play.
  with pytest.raises(ValueError, match=r"config.sft.domains: unknown domain 'bogus'; domains: math, "):
    SFTBatches(config, mesh=None, tc=None, tokenizer=None, renderer=None, ctx=None, loop=None)


def test_chat_files_errors_name_the_file_and_line(tmp_path, renderer):
  from rl.sft.source import chat_examples
  call = {"id": "c1", "type": "function", "function": {"name": "shell", "arguments": '{"command": "ls"}'}}
  tools = [{"type": "function", "function": {"name": "shell", "parameters": TOOL.parameters}}]

  def write(name, *convs, encoding="utf-8"):
    path = tmp_path / name
    text = "".join(json.dumps({"messages": m, "tools": tools}) + "\n" for m in convs)
    path.write_text(text, encoding=encoding)
    return path

  user = {"role": "user", "content": "hi"}
  orphan = write("orphan.jsonl", [user, {"role": "assistant", "content": "ok"},
                                  {"role": "tool", "tool_call_id": "zz", "content": "x"},
                                  {"role": "assistant", "content": "done"}])
  with pytest.raises(sft.ChatDataError, match=r"orphan.jsonl:1: .*tool_call_id: 'zz' matches no tool call"):
    chat_examples(str(orphan), renderer, None)
  unanswered = write("unanswered.jsonl", [user, {"role": "assistant", "content": "", "tool_calls": [call]},
                                          {"role": "assistant", "content": "done"}])
  with pytest.raises(sft.ChatDataError, match=r"unanswered.jsonl:1: field 'messages\[2\]': an assistant "
                     r"message while tool call\(s\) \['c1'\] have no tool result"):
    chat_examples(str(unanswered), renderer, None)
  ends_on_call = write("ends.jsonl", [user, {"role": "assistant", "content": "", "tool_calls": [call]}])
  assert len(chat_examples(str(ends_on_call), renderer, None)) == 1  # a conversation may end on a call
  reply = {"role": "assistant", "content": "no"}
  for name, conv, message in (
      ("w2", [user, dict(reply, weight=2)], r"messages\[1\].weight': is 2"),
      ("wu", [dict(user, weight=0), reply], r"messages\[0\].weight': is 0"),
      ("w0", [user, dict(reply, weight=0)], r"no assistant message with weight 1"),
  ):
    with pytest.raises(sft.ChatDataError, match=f"{name}.jsonl:1: field '.*{message}"):
      chat_examples(str(write(f"{name}.jsonl", conv)), renderer, None)
  # OpenAI's weight 0: the turn stays in the context and is masked out of the loss.
  first, more, second = ({"role": "assistant", "content": "first"}, {"role": "user", "content": "and?"},
                         {"role": "assistant", "content": "second"})
  both = chat_examples(str(write("both.jsonl", [user, first, more, second])), renderer, None)[0]
  off = [user, dict(first, weight=0), more, second]
  first_off = chat_examples(str(write("off.jsonl", off)), renderer, None)[0]
  np.testing.assert_array_equal(first_off.ids, both.ids)
  assert 0 < first_off.mask.sum() < both.mask.sum()
  assert first_off.mask[both.mask.argmax()] == 0 and first_off.mask[-1] == both.mask[-1] == 1
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n")
  with pytest.raises(sft.ChatDataError, match=r"config.sft.chat_files: .*empty.jsonl holds no conversations"):
    chat_examples(str(empty), renderer, None)
  utf16 = write("utf16.jsonl", [user, {"role": "assistant", "content": "ok"}], encoding="utf-16")
  with pytest.raises(sft.ChatDataError, match=r"utf16.jsonl: is not UTF-8 text"):
    chat_examples(str(utf16), renderer, None)


def test_chat_files_are_read_before_the_oracles_play(tmp_path, renderer):
  from configs import sft as sft_config
  from rl.sft.source import SFTBatches
  config = sft_config.get_config("tiny")
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  config.sft.update(domains="math", chat_files=str(empty))
  # ctx / loop are None: playing a maths oracle first would fail on them, not on the chat file.
  with pytest.raises(sft.ChatDataError, match="empty.jsonl holds no conversations"):
    SFTBatches(config, mesh=None, tc=None, tokenizer=None, renderer=renderer, ctx=None, loop=None)
