"""Tokenize pretraining sources into ArrayRecord shards + manifest (training/data.py).

    python -m experiments.prepare_data --config=configs/horizon.py:tiny
    python -m experiments.prepare_data --config=configs/horizon.py:small \
        --sources='stdlib=0.8;text:/data/**/*.md=0.2' --out=data/prepared/small
    python -m experiments.prepare_data --config=configs/pretrain.py:small   # uses config.data

Defaults: the tokenizer is `config.data.tokenizer` if the config has a `data`
section, else the one bundled for `config.variant`; sources are
`config.data.sources` or 'stdlib=1.0' (the running interpreter's standard
library, no download); the output is `config.data.prepared_dir` or
data/prepared/<variant>; `config.data.max_docs` caps documents per source.
Flags override the config. Re-running on prepared data is a no-op ("up to
date"). Prints one line per source and, last, a JSON summary.
"""

from __future__ import annotations

import json
import time

from absl import flags

from experiments.config_util import define_config_flag, run_app
from model.config import model_config
from training import data
from training.tokenizer import default_tokenizer_path, load_tokenizer

_CONFIG = define_config_flag()
_SOURCES = flags.DEFINE_string("sources", None, "Sources spec, e.g. 'stdlib=0.7;text:/d/*.md=0.3' "
                               "(default: config.data.sources or 'stdlib=1.0').")
_OUT = flags.DEFINE_string("out", None, "Output directory (default: config.data.prepared_dir or "
                           "data/prepared/<variant>).")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "Tokenizer file (default: config.data.tokenizer or "
                                 "the variant's bundled tokenizer).")
_MAX_DOCS = flags.DEFINE_integer("max_docs", None, "Keep only the first N documents of each source "
                                 "(default: config.data.max_docs; 0 = all).")
_DOCS_PER_SHARD = flags.DEFINE_integer("docs_per_shard", 256, "Documents per ArrayRecord shard.")


def _setting(config, flag, key: str, default):
  """Flag value, else config.data.<key> (when present and non-empty), else default."""
  if flag.value is not None:
    return flag.value
  section = config.get("data") if hasattr(config, "get") else None
  value = section.get(key) if section is not None else None
  return value if value else default


def main(argv):
  del argv
  config = _CONFIG.value
  cfg = model_config(config)
  # --tokenizer overrides config.data.tokenizer, so it is the way out of any tokenizer error here
  tok_path = (_setting(config, _TOKENIZER, "tokenizer", None)
              or default_tokenizer_path(config.variant, field="--tokenizer"))
  tokenizer = load_tokenizer(tok_path, model_vocab_size=cfg.vocab_size, image_token_id=cfg.image_token_id,
                             field="--tokenizer")
  sources = data.parse_sources(_setting(config, _SOURCES, "sources", "stdlib=1.0"))
  out = _setting(config, _OUT, "prepared_dir", f"data/prepared/{config.variant}")
  t0 = time.perf_counter()
  manifest = data.prepare(sources, tokenizer, out, docs_per_shard=_DOCS_PER_SHARD.value,
                          max_docs=_setting(config, _MAX_DOCS, "max_docs", 0) or None)
  seconds = time.perf_counter() - t0
  summary = data.manifest_summary(manifest)
  for name, s in summary.items():
    print(f"{name}: {s['documents']:,} docs, {s['tokens']:,} tokens, {s['shards']} shard(s), "
          f"weight {s['weight']:g}")
  print(json.dumps({"out": str(out), "tokenizer": tok_path, "tokenizer_fingerprint": tokenizer.fingerprint,
                    "sources": summary, "up_to_date": manifest["up_to_date"],
                    "rebuilt": manifest["rebuilt"], "seconds": round(seconds, 3)}))


if __name__ == "__main__":
  run_app(main)
