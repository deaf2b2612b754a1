"""serving/metrics.py: Prometheus series through prometheus_client, one registry per engine.

Several engines (and servers) live in one test or benchmark process, so each
EngineMetrics has its own CollectorRegistry; `/metrics` negotiates the text
format 0.0.4 or OpenMetrics from the scraper's Accept header.
"""

import httpx

from serving.metrics import EngineMetrics

KEY = "test-key"
OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def test_each_engine_has_its_own_registry():
  a, b = EngineMetrics(slots=2, max_context=16), EngineMetrics(slots=3, max_context=8)
  a.count_request("stop")
  a.count_request("stop")
  a.prompt_tokens.inc(5)
  a.ttft.observe(0.02)
  assert a.requests.value(status="stop") == 2 and b.requests.value(status="stop") == 0
  assert a.requests.value(status="length") == 0
  assert (a.slots_total.value(), b.slots_total.value()) == (2, 3)
  assert b.context_capacity.value() == 24
  text = a.render()
  assert 'horizon_requests_total{status="stop"} 2.0' in text and "horizon_prompt_tokens_total 5.0" in text
  assert 'horizon_time_to_first_token_seconds_bucket{le="0.025"} 1.0' in text
  assert "# TYPE horizon_inter_token_latency_seconds histogram" in text
  assert not any(line.startswith("horizon_requests_total") for line in b.render().splitlines())


def test_exposition_negotiates_the_format():
  m = EngineMetrics(slots=1, max_context=4)
  body, content_type = m.exposition(None)
  assert content_type.startswith("text/plain; version=0.0.4") and body.decode() == m.render()
  body, content_type = m.exposition(OPENMETRICS)
  assert content_type.startswith("application/openmetrics-text") and body.decode().endswith("# EOF\n")


def test_metrics_route_negotiates_the_format(server_url):
  auth = {"Authorization": f"Bearer {KEY}"}
  text = httpx.get(server_url + "/metrics", headers=auth)
  assert text.status_code == 200 and text.headers["content-type"].startswith("text/plain; version=0.0.4")
  assert "horizon_slots_total 4" in text.text
  om = httpx.get(server_url + "/metrics", headers={**auth, "Accept": OPENMETRICS})
  assert om.status_code == 200 and om.headers["content-type"].startswith("application/openmetrics-text")
  assert om.text.endswith("# EOF\n") and "horizon_slots_total 4" in om.text


def test_openai_usage_reports_prefix_cached_tokens(server_url, serve_config):
  """prompt_tokens_details.cached_tokens: the prompt tokens loaded from the prefix cache (was always
  0). A repeated prompt reuses whole blocks up to at least the last prefill chunk's start (blocks
  keep a decode-state snapshot where a prefill call ended on a block end), never its last token."""
  import random

  words = random.Random(11).choices("amber basil cedar delta ember fjord gable hazel".split(), k=20)
  body = {"model": "horizon-tiny", "max_tokens": 1, "temperature": 0,
          "messages": [{"role": "user", "content": " ".join(words)}]}
  auth = {"Authorization": f"Bearer {KEY}"}
  first, second = (httpx.post(server_url + "/v1/chat/completions", headers=auth, json=body, timeout=120)
                   for _ in range(2))
  assert first.status_code == second.status_code == 200, first.text
  u1, u2 = first.json()["usage"], second.json()["usage"]
  s = serve_config.serving
  n, block, chunk = u1["prompt_tokens"], s.prefix_cache_block, s.prefill_chunk
  cached = u2["prompt_tokens_details"]["cached_tokens"]
  assert n == u2["prompt_tokens"] > 2 * chunk
  assert (n - 1) // chunk * chunk <= cached < n and cached % block == 0, (n, cached)
  assert u1["prompt_tokens_details"]["cached_tokens"] < cached
