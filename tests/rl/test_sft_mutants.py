"""SFT data against references written out here (each test names the mistake it catches): packed
rows by hand, the loss mask of a thinking-off example by its special tokens, OpenAI chat fields
parsed to the messages they mean, tier mixes and tier choice at their bounds."""

import json
import re

import numpy as np
import pytest

from rl.sft import data as sft
from serving.chat import ChatRenderer
from serving.types import Message, TextPart, Tool, ToolCall
from training.tokenizer import default_tokenizer_path, load_tokenizer


@pytest.fixture(scope="module")
def renderer():
  return ChatRenderer(load_tokenizer(default_tokenizer_path("tiny")), num_image_tokens=0)


def _ex(ids, mask):
  return sft.Example(np.asarray(ids, np.int32), np.asarray(mask, np.int32))


def test_pack_rows_by_hand():
  """Catches an example of exactly seq_len + 1 tokens dropped, two examples filling a row exactly
  split over two, a target across a segment boundary trained, wrong counts."""
  exs = [_ex([10, 11, 12], [0, 1, 1]), _ex([20, 21, 22], [1, 0, 1]), _ex(range(30, 36), [1] * 6),
         _ex(range(40, 47), [1] * 7)]
  stats = sft.PackStats()
  rows = list(sft.pack(exs, seq_len=5, stats=stats))
  assert [{k: v.tolist() for k, v in r.items()} for r in rows] == [
    {"inputs": [10, 11, 12, 20, 21], "targets": [11, 12, 20, 21, 22], "positions": [0, 1, 2, 0, 1],
     "segment_ids": [1, 1, 1, 2, 2], "loss_mask": [1, 1, 0, 0, 1]},
    {"inputs": [30, 31, 32, 33, 34], "targets": [31, 32, 33, 34, 35], "positions": [0, 1, 2, 3, 4],
     "segment_ids": [1, 1, 1, 1, 1], "loss_mask": [1, 1, 1, 1, 1]},
  ]
  counts = (stats.examples, stats.dropped_too_long, stats.rows, stats.tokens, stats.target_tokens)
  assert counts == (4, 1, 2, 12, 8)


def test_pack_pads_the_last_row():
  """Catches the last partial row dropped, or padding counted as tokens or targets."""
  stats = sft.PackStats()
  rows = list(sft.pack([_ex([40, 41], [1, 1])], seq_len=5, stats=stats))
  assert [{k: v.tolist() for k, v in r.items()} for r in rows] == [
    {"inputs": [40, 41, 0, 0, 0], "targets": [41, 0, 0, 0, 0], "positions": [0, 1, 0, 0, 0],
     "segment_ids": [1, 1, 0, 0, 0], "loss_mask": [1, 0, 0, 0, 0]}]
  assert (stats.rows, stats.tokens, stats.target_tokens) == (1, 2, 1)


def test_row_index_is_a_fresh_permutation_per_epoch():
  """Catches the step not scaled by the batch size (batches overlap) and one permutation reused
  for every epoch."""
  n, bs = 5, 2
  picks = [sft.row_index(n, 3, step, bs, j) for step in range(5) for j in range(bs)]  # two epochs
  assert sorted(picks[:5]) == sorted(picks[5:]) == list(range(5))
  epochs = [[sft.row_index(n, 3, step, n, j) for j in range(n)] for step in range(3)]
  assert epochs[0] != epochs[1] or epochs[1] != epochs[2]


@pytest.mark.parametrize("text", ["=1", "low=inf", "low=-1,high=1", "low=0", "low=0,high=0"])
def test_bad_tier_mixes(text):
  """Catches an empty tier name, an infinite or negative weight, all weights zero accepted."""
  with pytest.raises(ValueError, match="tiers"):
    sft.parse_tier_mix(text)


def test_tier_mix_values():
  assert sft.parse_tier_mix("low=0.5, max, off=0") == {"low": 0.5, "max": 1.0, "off": 0.0}


def test_tier_for_thinking_bounds():
  """Catches a budget that must be exceeded (< for <=) and budgets taken in their dict order."""
  budgets = {"max": 96, "low": 8, "high": 32}
  assert [sft.tier_for_thinking(n, budgets) for n in (0, 8, 9, 32, 33, 96, 97)] == [
    "low", "low", "high", "high", "max", "max", "max"]


def test_thinking_off_trains_after_the_closed_think(renderer):
  """tier None: the prompt is <|assistant|><|think|><|/think|> and the loss starts after it.
  Catches thinking forced on (the <|/think|> would be trained as the model's own token)."""
  sp = {n: renderer.tokenizer.special_id(n) for n in ("assistant", "think", "/think", "end_of_turn")}
  msgs = [Message("system", [TextPart("s")]), Message("user", [TextPart("q")]),
          Message("assistant", [TextPart("a")])]
  ex = sft.render_example(renderer, msgs)
  ids = ex.ids.tolist()
  assert ids == renderer.render(msgs, thinking=False, add_generation_prompt=False).ids
  at = ids.index(sp["assistant"])
  assert ids[at + 1 : at + 3] == [sp["think"], sp["/think"]] and ids[-1] == sp["end_of_turn"]
  assert ex.mask.tolist() == [0] * (at + 3) + [1] * (len(ids) - at - 3)


def test_thinking_off_refuses_a_turn_that_thinks(renderer):
  """With thinking off, a turn with thinking is not what the model would continue from its
  prompt: the append-only check must refuse it, not train a wrong mask."""
  msgs = [Message("user", [TextPart("q")]), Message("assistant", [TextPart("a")], thinking="hmm")]
  with pytest.raises(AssertionError, match="append-only"):
    sft.render_example(renderer, msgs)


def _chat(*assistant, tools=None, **extra):
  obj = {"messages": [{"role": "user", "content": "q"}, *assistant], **extra}
  return obj if tools is None else {**obj, "tools": tools}


def test_chat_fields_parse_to_the_messages_they_mean():
  """Catches a None content read as text, text parts joined with a separator, developer not read as
  system, 'reasoning' not read as thinking, dict arguments not written as JSON, a tool's name
  dropped, a function tool without parameters given no object schema."""
  obj = {"messages": [
    {"role": "developer", "content": "sys"},
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    {"role": "assistant", "content": None, "reasoning": "r",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
    {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "out"},
    {"role": "assistant", "content": "done"}],
    "tools": [{"type": "function", "function": {"name": "f"}}]}
  messages, tools, untrained = sft.parse_chat(obj, "f:1")
  assert messages == [
    Message("system", [TextPart("sys")]), Message("user", [TextPart("ab")]),
    Message("assistant", [TextPart("")], thinking="r", tool_calls=[ToolCall("c1", "f", '{"x": 1}')]),
    Message("tool", [TextPart("out")], tool_call_id="c1", name="f"),
    Message("assistant", [TextPart("done")]),
  ]
  assert tools == [Tool("f", "", {"type": "object"})] and untrained == frozenset()


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
BAD_CHATS = [
  ({"messages": []}, "messages"),
  (_chat({"role": "assistant", "content": [{"type": "image_url", "text": "x"}]}), "messages[1].content[0]"),
  (_chat({"role": "assistant", "content": "a", "tool_calls": [{k: v for k, v in CALL.items() if k != "id"}]}),
   "messages[1].tool_calls[0]"),
  (_chat({"role": "assistant", "content": "a", "weight": True}), "messages[1].weight"),
  (_chat({"role": "assistant", "content": "a", "reasoning_content": ["r"]}), "messages[1].reasoning_content"),
  (_chat({"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "content": "x"}),
   "messages[2].tool_call_id"),
  # two calls, one answered: the next assistant turn is refused
  (_chat({"role": "assistant", "content": "", "tool_calls": [CALL, {**CALL, "id": "c2"}]},
         {"role": "tool", "tool_call_id": "c1", "content": "x"}, {"role": "assistant", "content": "a"}),
   "messages[3]"),
]


@pytest.mark.parametrize("obj, field", BAD_CHATS, ids=[b[1] for b in BAD_CHATS])
def test_bad_chat_fields_are_refused(obj, field):
  with pytest.raises(sft.ChatDataError, match="^" + re.escape(f"f:1: field '{field}'")):
    sft.parse_chat(obj, "f:1")


def test_uses_thinking_looks_at_every_assistant_turn():
  first = Message("assistant", [TextPart("")], thinking="t", tool_calls=[ToolCall("c", "f", "{}")])
  last = Message("assistant", [TextPart("a")])
  assert sft.uses_thinking([Message("user", [TextPart("q")]), first, last])
  assert not sft.uses_thinking([Message("user", [TextPart("q")]), last])


def test_chat_jsonl_numbers_past_the_limit_name_the_line(tmp_path):
  """A 5000-digit number is valid JSON that Python's int refuses (ValueError, not a JSONDecodeError):
  it ended the read without the file and line."""
  path = tmp_path / "c.jsonl"
  path.write_text(json.dumps(_chat({"role": "assistant", "content": "a"})) + "\n"
                  + '{"messages": [], "x": 1' + "0" * 5000 + "}\n")
  it = sft.load_chat_jsonl(path)
  assert next(it)[3] == f"{path}:1"
  with pytest.raises(sft.ChatDataError, match=r"c.jsonl:2: not valid JSON"):
    next(it)


@pytest.mark.parametrize("line, field", [
  ('{"messages": [{"role": "user", "content": "q"}], "messages": []}', "messages"),
  ('{"messages": [{"role": "user", "role": "assistant", "content": "a"}]}', "role"),
])
def test_chat_jsonl_refuses_a_key_given_twice(tmp_path, line, field):
  """json.loads kept the last value silently: a whole conversation, or a message's role, vanished
  from the training data (task files refused this already)."""
  path = tmp_path / "c.jsonl"
  path.write_text(line + "\n")
  with pytest.raises(sft.ChatDataError, match=rf"c.jsonl:1: field '{field}': appears twice in one object"):
    list(sft.load_chat_jsonl(path))


# ---- oracle conversations and chat files ---------------------------------------------------------


def _math(task_id, answer, thinking, by_tier=None):
  from rl.tasks.schema import parse_task
  turn = {"thinking": thinking, "content": f"<answer>{answer}</answer>"}
  return parse_task({"id": task_id, "domain": "math", "prompt": "2+2?", "answer": "4",
                     "oracle": [{**turn, "thinking_by_tier": by_tier} if by_tier else turn]})


def test_oracle_tier_fits_its_budget_exactly_and_failures_are_left_out(renderer):
  """A drawn tier whose thinking is exactly its budget is kept (not moved to the tier of the
  longer default thinking); an oracle whose answer is wrong is left out (a generator bug must not
  teach a wrong answer)."""
  from rl.agent.loop import LoopConfig
  from rl.envs.base import EnvContext
  from rl.sft.source import oracle_conversations

  tok = renderer.tokenizer
  low, default = "2 + 2 = 4", "Add 2 and 2: two more than 2 is 3, then 4. So the answer is 4."
  n_low, n_default = (len(tok.encode(t, allow_special=False)) for t in (low, default))
  assert n_low < n_default
  budgets = {"low": n_low, "high": n_default, "max": 10 * n_default}
  tasks = [_math("ok", 4, default, {"low": low}), _math("wrong", 5, default, {"low": low})]
  played = oracle_conversations(tasks, EnvContext(), LoopConfig(default_max_turns=1), budgets, tok, workers=1,
                                tiers={"low": 1.0})
  assert [(task.id, tier, msgs[-1].thinking) for msgs, _, tier, task in played] == [("ok", "low", low)]


def test_chat_files_without_thinking_render_thinking_off(tmp_path, renderer):
  """chat_tier '': a conversation without reasoning_content renders with thinking off (no effort
  line, the <|/think|> in the prompt), one with it at 'max'."""
  from rl.sft.source import chat_examples
  plain = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
  thinks = [plain[0], {**plain[1], "reasoning_content": "r"}]
  path = tmp_path / "c.jsonl"
  path.write_text("\ufeff" + "".join(json.dumps({"messages": m}) + "\n" for m in (plain, thinks)))  # a BOM
  got = chat_examples(str(path), renderer, None)
  msgs = [Message("user", [TextPart("q")]), Message("assistant", [TextPart("a")])]
  assert got[0].ids.tolist() == renderer.render(msgs, thinking=False, add_generation_prompt=False).ids
  msgs[1] = Message("assistant", [TextPart("a")], thinking="r")
  want = renderer.render(msgs, effort="max", thinking=True, add_generation_prompt=False).ids
  assert got[1].ids.tolist() == want
  assert [g.source for g in got] == [f"{path}:1", f"{path}:2"]


@pytest.mark.parametrize("spec", ["--1", "\u00b2", "1_0", "+1"])
def test_difficulties_that_are_not_plain_integers(spec):
  """Defect: '--1' and '\u00b2' passed isdigit() and then failed in int() without naming the field."""
  from rl.sft import checks
  message = f"config.sft.difficulties={spec!r}: {spec!r} is not an integer"
  with pytest.raises(ValueError, match=re.escape(message)):
    checks.sft_levels(spec, "math")


def _chat_batches(tmp_path, renderer, convs, seed=0):
  from configs import sft as sft_config
  from rl.sft.source import SFTBatches
  from training.train_step import TrainConfig
  config = sft_config.get_config("tiny")
  path = tmp_path / "chat.jsonl"
  path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs))
  config.sft.update(domains="", chat_files=str(path), seed=seed)
  tc = TrainConfig.from_config(config.train)
  return SFTBatches(config, None, tc, renderer.tokenizer, renderer, ctx=None, loop=None)


def _qa(question, answer="hello"):
  return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def test_chat_digest_counts_the_context_and_the_seed_orders_the_examples(tmp_path, renderer):
  """Catches a chat file's digest over its trained tokens only (an edited question resumed on
  silently) and examples packed in file order whatever config.sft.seed ('example order')."""
  digest = [_chat_batches(tmp_path, renderer, [_qa(q)]).digest for q in ("hi", "hi", "hey")]
  assert digest[0] == digest[1] != digest[2]
  convs = [_qa(f"question {i}", f"answer {'x' * i}") for i in range(8)]
  rows = [_chat_batches(tmp_path, renderer, convs, seed).rows for seed in (0, 1)]
  assert len(rows[0]) == len(rows[1]) == 1 and rows[0][0]["loss_mask"].sum() == rows[1][0]["loss_mask"].sum()
  assert rows[0][0]["inputs"].tolist() != rows[1][0]["inputs"].tolist()


def test_sft_levels_by_hand():
  """Catches 'all' missing the top level or refused with spaces around it, and levels left in
  the order given (the counts and the digest follow the level order)."""
  from rl.sft import checks
  assert checks.sft_levels(" all ", "math") == [0, 1, 2, 3, 4]
  assert checks.sft_levels("3, 0,4", "math") == [0, 3, 4]


def test_check_sft_config_checks_the_tier_mix():
  """The launcher checks config.sft before building the model and mesh: a bad tier mix must fail there."""
  from configs import sft as sft_config
  from rl.sft import checks
  config = sft_config.get_config("tiny")
  config.sft.tiers = "low=-1"
  with pytest.raises(ValueError, match=re.escape("config.sft.tiers: weight of tier 'low' is -1")):
    checks.check_sft_config(config)


def test_data_digest_of_oracle_and_chat_examples():
  """An oracle example counts by its trained tokens (tool results between them may differ from
  launch to launch); a chat example whole, its mask included."""
  from rl.sft.checks import DataDigest

  def digest(ex, **kw):
    d = DataDigest()
    d.add(ex, **kw)
    return d.hexdigest()

  a, b = _ex([1, 2, 3, 4], [0, 1, 0, 1]), _ex([1, 9, 3, 4], [0, 1, 0, 1])  # differ at 2, which is trained
  c = _ex([7, 2, 8, 4], [0, 1, 0, 1])  # differs from a where untrained only
  assert digest(a, tier="low") == digest(c, tier="low") != digest(b, tier="low")
  assert digest(a, tier="low") != digest(a, tier="high")
  assert digest(a, whole=True) != digest(c, whole=True)
  assert digest(a, whole=True) != digest(_ex([1, 2, 3, 4], [0, 1, 1, 1]), whole=True)
