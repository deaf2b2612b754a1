"""experiments/bench/decode.py: the roofline's bytes per decode step, the tokens/s it times and the
table and JSON its main prints, against numbers worked out by hand (the engines and the timing are
stand-ins, so the formulas are what is checked)."""

import json
import types

import numpy as np
import pytest
from absl import flags

from experiments.bench import decode


def _cfg(**kw):
  """The fields step_bytes reads: 2 DSA + 1 Delta layer, 8 experts of which 2 per token."""
  base = dict(num_experts=8, experts_per_token=2, jnp_dtype="bfloat16", layer_kinds=("dsa", "delta", "dsa"),
              index_head_dim=12, index_topk=16, kv_lora_rank=22, qk_rope_dim=6, delta_v_heads=4,
              delta_qk_heads=2, delta_qk_dim=10, delta_v_dim=6, delta_conv_size=4)
  return types.SimpleNamespace(**{**base, **kw})


def _state(f32=np.float32, bf16=np.float16):
  """Weights as the engine holds them (2-byte arrays stand in for bf16: nbytes is what counts)."""
  return {"embed": np.zeros((100, 8), bf16),  # excluded: a step gathers B rows
          "vision": {"w": np.zeros((50, 50), f32)},  # excluded: not used by a text decode step
          "head": np.zeros((8, 100), bf16),  # 1600 bytes
          "blocks": [{"attn": {"w": np.zeros((8, 10), bf16)},  # 160 bytes
                      "ffn": {"w_gate": np.zeros((8, 8, 5), f32),  # 8 experts of 160 bytes
                              "w_up": np.zeros((8, 8, 5), f32), "w_down": np.zeros((8, 5, 8), f32),
                              "w_router": np.zeros((8, 8), f32),  # 256 bytes
                              "shared": {"w_gate": np.zeros((8, 5), bf16)}}}]}  # 80 bytes: not an expert


def test_step_bytes_by_hand():
  engine = types.SimpleNamespace(cfg=_cfg(), _state=_state())
  # Batch 1: k = 2 distinct experts of each routed matrix: 3 x 2 x 160 = 960 bytes.
  got = decode.step_bytes(engine, 1, 100)
  weights = 1600 + 160 + 960 + 256 + 80
  # Per row, DSA layer: indexer keys 100 x 12 x 2 = 2400; top-16 latent + rope 16 x 28 x 2 = 896.
  # Delta layer: f32 state 4 x 10 x 6 x 4 = 960, conv history 3 x (2 x 2 x 10 + 4 x 6) x 2 = 384,
  # both read and written: 2 x 1344.
  state = 2 * (2400 + 896) + 2 * (960 + 384)
  assert got == {"weights": weights, "state": state, "total": weights + state}
  # Batch 4: 8 x (1 - (3/4)^4) = 5.46875 distinct experts; the state is per row. Context 10 < top-k.
  got = decode.step_bytes(engine, 4, 10)
  weights = 1600 + 160 + 3 * 160 * 5.46875 + 256 + 80
  state = 4 * (2 * (10 * 12 * 2 + 10 * 28 * 2) + 2 * (960 + 384))
  assert got["weights"] == pytest.approx(weights, rel=1e-12)
  assert got["state"] == state and got["total"] == pytest.approx(weights + state, rel=1e-12)


def test_step_bytes_without_experts_and_in_f32():
  state = _state()
  del state["blocks"][0]["ffn"]
  engine = types.SimpleNamespace(cfg=_cfg(num_experts=0, experts_per_token=0, jnp_dtype="float32",
                                          layer_kinds=("delta",)), _state=state)
  got = decode.step_bytes(engine, 3, 50)
  # Conv history in f32: 3 x 64 x 4 = 768; state 960; read and written, 3 rows.
  assert got == {"weights": 1760, "state": 3 * 2 * (960 + 768), "total": 1760 + 3 * 2 * (960 + 768)}


class _Handle:
  def __init__(self, stamps):
    self._stamps = stamps

  def events(self):  # two events: one token, then the rest in one event
    yield types.SimpleNamespace(time=self._stamps[0], token_ids=[7])
    yield types.SimpleNamespace(time=self._stamps[-1], token_ids=[7] * (len(self._stamps) - 1))


class _Engine:
  """Records what is submitted and answers with fixed token times per request."""

  def __init__(self, stamps):
    self.stamps, self.requests = list(stamps), []
    self.tokenizer = types.SimpleNamespace(special_id=lambda name: {"bos": 1}[name])

  def submit(self, request):
    self.requests.append(request)
    return _Handle(self.stamps.pop(0))


def test_decode_rate_counts_tokens_after_the_first_over_the_common_span():
  # Request 0: first token at 1.0, 4 more by 5.0; request 1: first at 2.0, 2 more by 4.0.
  engine = _Engine([[1.0, 5.0, 5.0, 5.0, 5.0], [2.0, 4.0, 4.0]])
  rate = decode.decode_rate(engine, 2, 5, 4, vocab=300)
  assert rate == (4 + 2) / (5.0 - 2.0)  # from the last first token to the last token
  for r in engine.requests:
    assert len(r.prompt_ids) == 5 and all(3 <= t < 300 for t in r.prompt_ids)
    assert r.params.max_tokens == 4 and r.params.temperature == 0.0 and r.params.stop_token_ids == [1]
  assert engine.requests[0].prompt_ids != engine.requests[1].prompt_ids
  again = _Engine([[1.0, 2.0], [1.0, 2.0]])  # another engine at the same batch gets the same prompts
  decode.decode_rate(again, 2, 5, 4, vocab=300)
  assert [r.prompt_ids for r in again.requests] == [r.prompt_ids for r in engine.requests]


class _FakeEngine:
  def __init__(self, name, **kw):
    self.name, self.kw = name, kw
    self.cfg = types.SimpleNamespace(vocab_size=331, dtype="bfloat16")
    self.slots, self.prefill_chunk, self.model, self.tokenizer = 2, 32, "model", "tokenizer"

  def start(self):
    pass

  def stop(self):
    pass


def test_main_table_and_json(monkeypatch, capsys):
  built = {}

  def build_engine(config):
    built["serving"] = dict(config.serving)
    return _FakeEngine("buckets")

  def engine(model, tokenizer, compute_dtype_weights=True, decode_steps=1, **kw):
    name = "stored" if not compute_dtype_weights else ("held" if decode_steps == 1 else "ahead")
    return _FakeEngine(name, decode_steps=decode_steps, **kw)

  speed = {"stored": 100.0, "held": 150.0, "ahead": 300.0, "buckets": 330.0}
  calls, reps = [], {}

  def decode_rate(eng, batch, prompt, new, vocab):
    calls.append((eng.name, batch, prompt, new, vocab))
    if new == 4:  # the compile warm-up
      return 1.0
    k = reps[eng.name, batch] = reps.get((eng.name, batch), -1) + 1
    return speed[eng.name] * batch * (1.0, 1.2, 0.5)[k]  # median 1.0 x, mean 0.9 x

  def step_bytes(eng, batch, context):
    assert eng.name == "held" and context == 40 + 16 // 2  # the roofline of the compute-dtype engine
    return {"total": 2 ** 20 * (1 + batch)}

  monkeypatch.setattr(decode, "build_engine", build_engine)
  monkeypatch.setattr(decode, "Engine", engine)
  monkeypatch.setattr(decode, "decode_rate", decode_rate)
  monkeypatch.setattr(decode, "step_bytes", step_bytes)
  monkeypatch.setattr(decode, "read_bandwidth", lambda mib: 2e9)
  monkeypatch.setattr(decode, "report_cpu", lambda: {})
  flags.FLAGS(["decode", "--quick", "--batches=1,2", "--repeats=3", "--decode_steps=4"])
  try:
    decode.main([])
  finally:
    flags.FLAGS.unparse_flags()
  assert {built["serving"][k] for k in ("slots", "prefix_cache_mb", "decode_steps")} == {2, 0, 4}
  assert built["serving"]["max_context"] == 128
  # Every engine decodes the same work: warm-ups at 4 tokens, then 3 timed runs of 16 per batch.
  for name in speed:
    assert [c[1:] for c in calls if c[0] == name] == [(1, 40, 4, 331), (2, 40, 4, 331)] + \
        [(1, 40, 16, 331)] * 3 + [(2, 40, 16, 331)] * 3
  lines = capsys.readouterr().out.splitlines()
  # Batch 2 of the stored engine: 200 tok/s; roofline 2 x 2e9 / 3 MiB = 1271.6 tok/s; 15.7 %.
  roof2 = 2 * 2e9 / (3 * 2 ** 20)
  row = f"{'stored f32':>14} {2:>5} {200.0:>8.1f} {roof2:>9.1f} {100 * 200 / roof2:>7.1f}% {3.0:>9.1f}"
  assert row in lines
  got = json.loads(lines[-1])
  roof = {1: 2e9 / (2 * 2 ** 20), 2: roof2}
  names = {"stored": "stored f32", "held": "compute dtype", "ahead": "+ 4 steps", "buckets": "+ row buckets"}
  assert got["read_gb_per_s"] == 2.0
  assert got["tokens_per_s"] == {f"{names[n]}/{b}": speed[n] * b for n in speed for b in (1, 2)}
  assert got["roofline_fraction"] == {f"{names[n]}/{b}": round(speed[n] * b / roof[b], 4)
                                      for n in speed for b in (1, 2)}
  assert got["compute_dtype_over_stored"] == {"1": 1.5, "2": 1.5}
  assert got["run_ahead_over_one_step"] == {"1": 2.0, "2": 2.0}
  assert got["buckets_over_all_slots"] == {"1": 1.1, "2": 1.1}
