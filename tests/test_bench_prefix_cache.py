"""experiments/bench/prefix_cache.py on tiny: the conversation is append-only, the cache is used."""

from configs import serve
from experiments.bench import prefix_cache as bench
from serving.chat import ChatRenderer
from training.tokenizer import default_tokenizer_path, load_tokenizer


def test_conversation_turns_extend_each_other():
  renderer = ChatRenderer(load_tokenizer(default_tokenizer_path("tiny")), 0)
  convo = bench.conversation(renderer, 3, 10, 2, 3)
  for (prompt, completion), (following, _) in zip(convo, convo[1:], strict=False):
    assert following[:len(prompt) + len(completion) - 1] == prompt + completion[:-1]
    assert len(following) > len(prompt) + len(completion)


def test_two_turns_reuse_the_first():
  config = serve.get_config("tiny")
  config.model.max_seq_len = 1024
  config.serving.update(max_context=1024, slots=2)
  out = bench.run(config, 2, 1, (10, 2, 3))
  first, second = out["rows"]
  assert first["reused_tokens"] == 0
  # Everything of turn 1 but the last partial block (and the unfed end of turn) is reused.
  assert second["reused_tokens"] >= second["prompt_tokens"] - 60
  assert all(r["ttft_off_ms"] > 0 and r["ttft_on_ms"] > 0 for r in out["rows"])
