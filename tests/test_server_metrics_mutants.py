"""serving.metrics edge cases that mutation testing found unchecked: EngineMetrics.observe moves every
gauge and the eviction counter by exactly the engine's state, and the prefix-cache hit rate."""

from serving.metrics import EngineMetrics


class _Prefix:
  """The parts of serving/prefix_cache.PrefixCache that observe reads."""

  def __init__(self, blocks: int, nbytes: int, evictions: int):
    self.blocks, self.nbytes, self.evictions = blocks, nbytes, evictions

  def __len__(self) -> int:
    return self.blocks


def _line(m: EngineMetrics, name: str) -> str:
  return next(line for line in m.render().splitlines() if line.startswith(name + " "))


def test_observe_sets_the_gauges_to_the_engine_state():
  m = EngineMetrics(slots=4, max_context=64)
  m.observe([5, 17, 3], waiting=2, prefix=None)
  assert (m.slots_used.value(), m.context_used.value(), m.queue_length.value()) == (3, 25, 2)
  m.observe([9], waiting=0, prefix=None)  # set, not added: one busy slot of 9 tokens, nothing queued
  assert (m.slots_used.value(), m.context_used.value(), m.queue_length.value()) == (1, 9, 0)
  m.observe([], waiting=5, prefix=None)
  assert (m.slots_used.value(), m.context_used.value(), m.queue_length.value()) == (0, 0, 5)
  assert _line(m, "horizon_context_tokens_used") == "horizon_context_tokens_used 0.0"
  assert (m.prefix_blocks.value(), m.prefix_evictions.value()) == (0, 0)  # cache off: untouched


def test_observe_counts_each_eviction_once():
  m = EngineMetrics(slots=2, max_context=16)
  m.observe([], 0, _Prefix(blocks=6, nbytes=6000, evictions=0))
  assert (m.prefix_blocks.value(), m.prefix_bytes.value(), m.prefix_evictions.value()) == (6, 6000, 0)
  m.observe([], 0, _Prefix(blocks=4, nbytes=4000, evictions=3))
  m.observe([], 0, _Prefix(blocks=4, nbytes=4000, evictions=3))  # no new eviction since the last call
  assert (m.prefix_blocks.value(), m.prefix_bytes.value(), m.prefix_evictions.value()) == (4, 4000, 3)
  m.observe([], 0, _Prefix(blocks=0, nbytes=0, evictions=7))  # an emptied cache still reports
  assert (m.prefix_blocks.value(), m.prefix_bytes.value(), m.prefix_evictions.value()) == (0, 0, 7)
  assert _line(m, "horizon_prefix_cache_evictions_total") == "horizon_prefix_cache_evictions_total 7.0"


def test_prefix_hit_rate_is_reused_over_prompt_tokens():
  m = EngineMetrics(slots=1, max_context=8)
  assert m.prefix_hit_rate.value() == 0.0  # no prompt yet: 0, not a division by zero
  m.prompt_tokens.inc(40)
  assert m.prefix_hit_rate.value() == 0.0
  m.prefix_reused_tokens.inc(10)
  assert m.prefix_hit_rate.value() == 0.25
  m.prompt_tokens.inc(60)
  m.prefix_reused_tokens.inc(65)
  assert m.prefix_hit_rate.value() == 0.75
  assert _line(m, "horizon_prefix_cache_hit_rate") == "horizon_prefix_cache_hit_rate 0.75"


def test_counter_values_by_label():
  m = EngineMetrics(slots=1, max_context=8)
  for status in ["stop", "length", "stop", "rejected", "overloaded", "overloaded", "overloaded"]:
    m.count_request(status)
  assert [m.requests.value(status=s) for s in ["stop", "length", "rejected", "overloaded", "error"]] == \
      [2, 1, 1, 3, 0]
