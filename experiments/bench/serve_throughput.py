"""Serving throughput: generated tokens/s at 1, 4 and 16 concurrent streaming clients.

    flock /tmp/horizon_heavy.lock python -m experiments.bench.serve_throughput           # small
    flock /tmp/horizon_heavy.lock python -m experiments.bench.serve_throughput --quick   # tiny
    python -m experiments.bench.serve_throughput --checkpoint=DIR --config=configs/serve.py:small

Starts the real server in-process (serving.server.create_app, uvicorn on
127.0.0.1 in a thread; the engine's loop in its own thread) and drives it with
the official `openai` SDK (AsyncOpenAI, streaming, `include_usage`) exactly as
a client would. Each of C clients sends `--requests` requests back to back
(fixed prompt and max_tokens, sampled with per-request seeds); the level's
throughput is all generated tokens (from `usage`) over the level's wall
time, median over `--reps` repetitions. Continuous batching should make 16
clients much faster in total than one: a decode step over the engine's slots
costs little more than a one-row step on this CPU, so the ratio measures how
much of that the scheduler turns into throughput.

Latencies per request: time to first token = request sent -> first chunk
carrying generated text (content or reasoning), as a client sees it (HTTP,
SSE and held-back partial UTF-8 included); inter-token latency = the gaps
between successive text chunks. The warm-up (compiling the engine's fixed
shapes) is one request before timing. Last line: JSON with
`throughput_ratio_16_vs_1`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time

import openai
from absl import app, flags
from ml_collections import config_flags

from configs import serve
from experiments.bench.common import quick_flag
from serving.build import build_engine
from serving.server import BackgroundServer, create_app

_CONFIG = config_flags.DEFINE_config_file("config", None, "Serve config; default configs/serve.py:small "
                                          "(tiny with --quick).", lock_config=False)
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Checkpoint dir; unset: random init.")
_QUICK = quick_flag("tiny config, fewer tokens and requests.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", None, "Tokens per request (default 64; quick 24).")
_REQUESTS = flags.DEFINE_integer("requests", None, "Requests per client per level (default 2; quick 1).")
_REPS = flags.DEFINE_integer("reps", None, "Repetitions per level, median reported (default 3; quick 1).",
                            lower_bound=1)
_LEVELS = (1, 4, 16)
PROMPT = "Write a short story about a fox who learns to count the stars, one by one, every night."
API_KEY = "bench"


async def _one(client, model: str, seed: int, max_tokens: int) -> dict:
  t0 = time.perf_counter()
  stream = await client.chat.completions.create(
      model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens,
      temperature=1.0, seed=seed, stream=True, stream_options={"include_usage": True})
  stamps, tokens = [], 0
  async for chunk in stream:
    if chunk.usage is not None:
      tokens = chunk.usage.completion_tokens
    for choice in chunk.choices:
      d = choice.delta
      if d.content or (d.model_extra or {}).get("reasoning_content"):
        stamps.append(time.perf_counter())
  ttft = stamps[0] - t0 if stamps else float("nan")
  return {"tokens": tokens, "ttft": ttft, "gaps": [b - a for a, b in zip(stamps, stamps[1:], strict=False)]}


async def _level(client, model: str, clients: int, requests: int, max_tokens: int, seed0: int) -> dict:
  async def worker(c: int) -> list[dict]:
    return [await _one(client, model, seed0 + c * requests + r, max_tokens) for r in range(requests)]

  t0 = time.perf_counter()
  results = [r for rs in await asyncio.gather(*(worker(c) for c in range(clients))) for r in rs]
  wall = time.perf_counter() - t0
  return {"wall": wall, "tokens": sum(r["tokens"] for r in results),
          "ttft": [r["ttft"] for r in results], "gaps": [g for r in results for g in r["gaps"]]}


async def _bench(url: str, max_tokens: int, requests: int, reps: int) -> list[dict]:
  async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0,
                                timeout=3600) as client:
    model = (await client.models.list()).data[0].id
    await _one(client, model, 0, max_tokens)  # the server is warm (serving/warmup.py); this warms the client
    rows = []
    for clients in _LEVELS:
      runs = [await _level(client, model, clients, requests, max_tokens, 1000 * (rep + 1))
              for rep in range(reps)]
      tps = [r["tokens"] / r["wall"] for r in runs]
      ttft = [t for r in runs for t in r["ttft"]]
      gaps = [g for r in runs for g in r["gaps"]] or [float("nan")]
      rows.append({"clients": clients, "requests": clients * requests,
                   "tokens": round(statistics.fmean(r["tokens"] for r in runs)),
                   "tokens_per_s": statistics.median(tps),
                   "ttft_mean_ms": 1e3 * statistics.fmean(ttft),
                   "ttft_p50_ms": 1e3 * statistics.median(ttft),
                   "itl_mean_ms": 1e3 * statistics.fmean(gaps), "itl_p50_ms": 1e3 * statistics.median(gaps)})
  return rows


def main(argv) -> None:
  del argv
  for name in ("httpx", "httpx2"):  # the SDK logs one INFO line per request otherwise
    logging.getLogger(name).setLevel(logging.WARNING)
  quick = _QUICK.value
  config = _CONFIG.value
  if config is None:
    config = serve.get_config("tiny" if quick else "small")
  config.serving.api_key = API_KEY
  max_tokens = _MAX_TOKENS.value or (24 if quick else 64)
  requests = _REQUESTS.value or (1 if quick else 2)
  reps = _REPS.value or (1 if quick else 3)
  engine = build_engine(config, _CHECKPOINT.value).start()
  server = BackgroundServer(create_app(engine, engine.tokenizer, config)).start()
  server.wait_ready()
  try:
    rows = asyncio.run(_bench(server.url, max_tokens, requests, reps))
  finally:
    server.stop()
    engine.stop()
  print(f"model {config.serving.model_name}: {engine.slots} slots, max_tokens {max_tokens}, "
        f"{requests} request(s) per client, median of {reps}")
  print(f"{'clients':>7} {'requests':>8} {'tokens':>7} {'tok/s':>9} {'TTFT mean':>10} {'TTFT p50':>9} "
        f"{'ITL mean':>9} {'ITL p50':>8}")
  for r in rows:
    print(f"{r['clients']:>7} {r['requests']:>8} {r['tokens']:>7} {r['tokens_per_s']:>9.1f} "
          f"{r['ttft_mean_ms']:>8.0f}ms {r['ttft_p50_ms']:>7.0f}ms {r['itl_mean_ms']:>7.1f}ms "
          f"{r['itl_p50_ms']:>6.1f}ms")
  by = {r["clients"]: r for r in rows}
  print(json.dumps({"model": config.serving.model_name, "max_tokens": max_tokens,
                    "tokens_per_s": {str(k): round(v["tokens_per_s"], 2) for k, v in by.items()},
                    "ttft_p50_ms": {str(k): round(v["ttft_p50_ms"], 1) for k, v in by.items()},
                    "itl_p50_ms": {str(k): round(v["itl_p50_ms"], 2) for k, v in by.items()},
                    "throughput_ratio_16_vs_1": round(by[16]["tokens_per_s"] / by[1]["tokens_per_s"], 2),
                    "throughput_ratio_4_vs_1": round(by[4]["tokens_per_s"] / by[1]["tokens_per_s"], 2)}))


if __name__ == "__main__":
  app.run(main)
