"""Pretraining data: text sources -> tokenized ArrayRecord shards -> a grain pipeline.

Two stages, so that tokenization (slow, done once) is separate from reading
(fast, deterministic, resumable):

1. `prepare(sources, tokenizer, out_dir)` (sources: `parse_sources(spec)`,
   training/data_sources.py) tokenizes every document of every
   source, appends `eos_id`, and writes ArrayRecord shards
   `out_dir/<source>/shard-00000-of-000NN.arrayrecord` plus a manifest. Each
   record is the magic b"HZD1" followed by little-endian uint32 token ids, so
   a shard written by anything else is rejected ("foreign shard") instead of
   being read as garbage tokens. The manifest records the tokenizer
   fingerprint, the inputs' fingerprint (file list + sizes + mtimes) and each
   shard's record count and sha256: re-running with unchanged inputs is a
   no-op, a changed input or tokenizer rebuilds only what changed, and a
   damaged shard is caught before training reads it.

2. `make_lm_dataset(prepared_dir, ...)` is a grain pipeline (google/grain):
   per source `MapDataset.source(ArrayRecordDataSource)` -> this process's
   slice `[process_index::process_count]` (processes read disjoint documents)
   -> `shuffle(seed)` (a new permutation each epoch) -> `repeat()`; the
   sources are combined by `MapDataset.mix` so that each one's share of the
   tokens is its weight (documents are drawn in proportion to weight / mean
   tokens per document, from the manifest); then packing and batching.
   Every stage is index-based or checkpoints its own state, so
   `iter(ds).get_state()` is a small JSON-able dict and `set_state` resumes
   bit-exactly.

Packing. A document d (tokens ending in eos) becomes the next-token pair
inputs = d[:-1], targets = d[1:], so no target ever crosses into another
document (the last real token predicts eos; nothing is trained to predict a
document's first token from the previous document).
  * 'concat' (`grain.experimental.ConcatThenSplitIterDataset`): pairs are
    concatenated and cut into rows of seq_len, no padding. A document cut by
    a row boundary continues in the next row as a new segment whose positions
    restart at 0. We chose the restart because the model cannot attend across
    rows anyway: the continuation *is* a fresh context, and position 0 at
    every segment start keeps one invariant for both packers and for decode
    (prefill always starts at 0). The target of a row's last token is still
    the true next token of the document.
  * 'first_fit' (`grain.experimental.FirstFitPackIterDataset`): documents are
    first cut into pieces of at most seq_len pairs (positions restart at 0 in
    each piece, as above), then packed whole into rows, padded at the end
    (segment id 0, loss_mask 0).
Segment ids are 1-based per row; 0 is padding.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any, Callable, Iterator, Sequence

import grain
import numpy as np
from array_record.python import array_record_module
from etils import epath

from model.config import is_int
from training.data_sources import (  # noqa: F401 (parse_sources, KINDS: re-exported API)
  KINDS,
  DataError,
  Source,
  check_first_documents,
  input_fingerprint,
  iter_documents,
  parse_sources,
  source_files,
)

FORMAT_VERSION = 1
RECORD_MAGIC = b"HZD1"
MANIFEST_NAME = "manifest.json"
SOURCE_META_NAME = "source.json"
PACKINGS = ("concat", "first_fit")
_WRITER_OPTIONS = "group_size:1"  # one record per chunk: cheap random access
_ENCODE_BATCH = 64


# ---- records -------------------------------------------------------------------


def encode_record(tokens: Sequence[int]) -> bytes:
  """RECORD_MAGIC + little-endian uint32 ids."""
  return RECORD_MAGIC + np.asarray(tokens, dtype="<u4").tobytes()


def decode_record(record: bytes, where: str = "record") -> np.ndarray:
  """The int32 token ids of a record; DataError if it is not a Horizon record."""
  if not record.startswith(RECORD_MAGIC) or (len(record) - len(RECORD_MAGIC)) % 4:
    raise DataError(f"{where}: foreign record (no {RECORD_MAGIC!r} magic or a ragged length): this "
                    "shard was not written by prepare_data. Delete the prepared directory and "
                    "re-run `python -m experiments.prepare_data`.")
  return np.frombuffer(record, dtype="<u4", offset=len(RECORD_MAGIC)).astype(np.int32)


def _sha256(path: epath.Path) -> str:
  h = hashlib.sha256()
  with path.open("rb") as f:
    while chunk := f.read(1 << 22):
      h.update(chunk)
  return h.hexdigest()


# ---- prepare -------------------------------------------------------------------


def tokenizer_info(tokenizer) -> dict[str, Any]:
  """What the manifest records about the tokenizer (rebuild when it changes)."""
  return {"fingerprint": str(tokenizer.fingerprint), "vocab_size": int(tokenizer.vocab_size),
          "eos_id": int(tokenizer.eos_id)}


def _encode_all(tokenizer, texts: list[str]) -> list[list[int]]:
  batch = getattr(tokenizer, "encode_batch", None)
  return list(batch(texts)) if callable(batch) else [tokenizer.encode(t) for t in texts]


def _source_config(source: Source, docs_per_shard: int, max_docs: int | None) -> dict[str, Any]:
  return {"kind": source.kind, "pattern": source.pattern, "field": source.field,
          "docs_per_shard": docs_per_shard, "max_docs": max_docs}


def _read_json(path: epath.Path) -> Any:
  try:
    return json.loads(path.read_text())
  except (OSError, json.JSONDecodeError):
    return None


def _is_current(out: epath.Path, source: Source, config: dict, tok: dict, fp: str) -> dict | None:
  """The source's stored meta if it matches config, tokenizer and inputs and its shards exist."""
  meta = _read_json(out / source.name / SOURCE_META_NAME)
  if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
    return None
  if meta.get("config") != config or meta.get("tokenizer") != tok or meta.get("input_fingerprint") != fp:
    return None
  for shard in meta.get("shards", []):
    p = out / shard["file"]
    if not p.exists() or p.stat().length != shard["bytes"]:
      return None
  return meta


def _write_shards(partial: epath.Path, docs: Iterator[list[int]], docs_per_shard: int) -> list[int]:
  """Writes records into partial/shard-K.tmp files; returns records per shard."""
  counts: list[int] = []
  writer = None
  for ids in docs:
    if writer is None or counts[-1] == docs_per_shard:
      if writer is not None:
        writer.close()
      writer = array_record_module.ArrayRecordWriter(
          str(partial / f"shard-{len(counts):05d}.tmp"), _WRITER_OPTIONS)
      counts.append(0)
    writer.write(encode_record(ids))
    counts[-1] += 1
  if writer is not None:
    writer.close()
  return counts


def _tokenized(source: Source, files, tokenizer, max_docs: int | None, stats: dict) -> Iterator[list[int]]:
  texts: list[str] = []

  def flush():
    for ids in _encode_all(tokenizer, texts):
      stats["documents"] += 1
      stats["tokens"] += len(ids) + 1
      yield list(ids) + [int(tokenizer.eos_id)]
    texts.clear()

  for text in iter_documents(source, files):
    if max_docs is not None and stats["documents"] + len(texts) >= max_docs:
      break
    texts.append(text)
    if len(texts) == _ENCODE_BATCH:
      yield from flush()
  yield from flush()


def _build_source(out: epath.Path, source: Source, files, tokenizer, config: dict, tok: dict,
                  fp: str) -> dict:
  """Tokenizes one source into a temp dir, then swaps it in (an interrupted build never counts)."""
  partial = out / f".{source.name}.partial"
  if partial.exists():
    partial.rmtree()
  partial.mkdir(parents=True)
  stats = {"documents": 0, "tokens": 0}
  counts = _write_shards(partial, _tokenized(source, files, tokenizer, config["max_docs"], stats),
                         config["docs_per_shard"])
  if not counts:
    partial.rmtree()
    raise DataError(f"source {source.name} ({source.kind}:{source.pattern}): no non-empty documents.")
  shards = []
  for k, n in enumerate(counts):
    final = partial / f"shard-{k:05d}-of-{len(counts):05d}.arrayrecord"
    (partial / f"shard-{k:05d}.tmp").rename(final)
    shards.append({"file": f"{source.name}/{final.name}", "records": n,
                   "bytes": final.stat().length, "sha256": _sha256(final)})
  meta = {"format": FORMAT_VERSION, "config": config, "tokenizer": tok, "input_fingerprint": fp,
          "documents": stats["documents"], "tokens": stats["tokens"], "shards": shards}
  (partial / SOURCE_META_NAME).write_text(json.dumps(meta, indent=1))
  # The old folder is renamed away first and removed last: a kill mid-rmtree left a source folder
  # without its source.json, which the next prepare refused as not its own (no restart).
  final_dir, old = out / source.name, _old_dir(out, source)
  if final_dir.exists():
    final_dir.rename(old)
  partial.rename(final_dir)
  if old.exists():
    old.rmtree()
  return meta


def _old_dir(out: epath.Path, source: Source) -> epath.Path:
  """Where a rebuild moves a source's previous folder before removing it."""
  return out / f".{source.name}.old"


def _outside(files: list, out: epath.Path) -> list:
  """The files not under the output directory (local paths; remote ones are kept)."""
  if "://" in str(out):
    return files
  root = os.path.realpath(out)
  return [f for f in files if "://" in str(f) or not os.path.realpath(f).startswith(root + os.sep)]


def _check_ours(out: epath.Path, sources: Sequence[Source]) -> None:
  """Refuses an output directory whose manifest or source folders `prepare` did not write.

  Rebuilding a source removes its folder and the manifest is replaced, so a directory holding
  someone else's `manifest.json` or a folder named like a source lost those files.
  """
  if not out.exists():
    return
  if not out.is_dir():
    raise DataError(f"{out} is a file; prepare writes a directory of shards: choose another path.")
  manifest = out / MANIFEST_NAME
  theirs = []
  if manifest.exists():
    m = _read_json(manifest)
    if not (isinstance(m, dict) and m.get("record_magic") == RECORD_MAGIC.decode() and "sources" in m):
      theirs.append(MANIFEST_NAME)
  for source in sources:
    folder = out / source.name
    if folder.exists():
      meta = _read_json(folder / SOURCE_META_NAME) if folder.is_dir() else None
      if not (isinstance(meta, dict) and "format" in meta and "shards" in meta):
        theirs.append(source.name)
  if theirs:
    raise DataError(f"{out} holds {', '.join(repr(t) for t in theirs)}, which prepare did not write and "
                    "would replace; choose an empty directory (--out, or config.data.prepared_dir) or move "
                    "them.")


def prepare(sources: Sequence[Source], tokenizer, out_dir, docs_per_shard: int = 256,
            max_docs: int | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
  """Tokenizes `sources` into ArrayRecord shards under `out_dir`; returns the manifest.

  `tokenizer` needs encode(text) -> ids (or encode_batch), eos_id, vocab_size
  and fingerprint. A source whose config, tokenizer and input fingerprint
  match what is on disk is kept as is. The returned dict is the manifest
  written to out_dir/manifest.json plus two keys that are not stored:
  "up_to_date" (nothing was rebuilt or rewritten) and "rebuilt" (names).
  """
  if not sources:
    raise DataError("prepare: no sources given; e.g. parse_sources('stdlib=1.0').")
  if len({s.name for s in sources}) != len(sources):
    raise DataError(f"prepare: duplicate source names {[s.name for s in sources]}.")
  if not isinstance(docs_per_shard, int) or docs_per_shard < 1:
    raise DataError(f"prepare: docs_per_shard={docs_per_shard!r} must be a positive int.")
  if max_docs is not None and (not isinstance(max_docs, int) or max_docs < 1):
    raise DataError(f"prepare: max_docs={max_docs!r} must be a positive int or None.")
  out = epath.Path(out_dir)
  _check_ours(out, sources)
  out.mkdir(parents=True, exist_ok=True)
  tok = tokenizer_info(tokenizer)
  for source in sources:  # what a rebuild killed while removing the old folder left behind
    if _old_dir(out, source).exists():
      _old_dir(out, source).rmtree()
  # Every source's files first: a source matching nothing fails before any is tokenized. Files
  # under the output directory are never inputs (a glob over its parent read the shards as text).
  inputs = [(source, _outside(source_files(source), out)) for source in sources]
  for source, files in inputs:
    check_first_documents(source, files)
  entries, rebuilt = {}, []
  for source, files in inputs:
    config = _source_config(source, docs_per_shard, max_docs)
    fp = input_fingerprint(source, files)
    meta = _is_current(out, source, config, tok, fp)
    if meta is None:
      log(f"{source.name}: tokenizing {len(files)} file(s) from {source.kind}:{source.pattern or '-'}")
      meta = _build_source(out, source, files, tokenizer, config, tok, fp)
      rebuilt.append(source.name)
    entries[source.name] = {"weight": source.weight, **{k: v for k, v in meta.items()
                                                          if k not in ("format", "tokenizer")}}
  manifest = {"format": FORMAT_VERSION, "record_magic": RECORD_MAGIC.decode(), "tokenizer": tok,
              "sources": entries}
  up_to_date = not rebuilt and _read_json(out / MANIFEST_NAME) == manifest
  if up_to_date:
    log(f"{out}: up to date")
  else:
    tmp = out / f"{MANIFEST_NAME}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(out / MANIFEST_NAME)
  return {**manifest, "up_to_date": up_to_date, "rebuilt": rebuilt}


def manifest_summary(manifest: dict[str, Any]) -> dict[str, Any]:
  """Per-source documents / tokens / shards / weight (no per-shard detail)."""
  return {name: {"documents": e["documents"], "tokens": e["tokens"], "shards": len(e["shards"]),
                 "weight": e["weight"]} for name, e in manifest["sources"].items()}


# ---- reading -------------------------------------------------------------------

_FIX = "Delete the prepared directory and re-run `python -m experiments.prepare_data`."


def load_manifest(prepared_dir) -> dict[str, Any]:
  """The manifest of a prepared directory; DataError if missing or not ours."""
  path = epath.Path(prepared_dir) / MANIFEST_NAME
  if not path.exists():
    raise DataError(f"{path} does not exist: the data is not prepared (or preparation was "
                    "interrupted). Run `python -m experiments.prepare_data --out=...`.")
  manifest = _read_json(path)
  if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION or \
      manifest.get("record_magic") != RECORD_MAGIC.decode():
    raise DataError(f"{path}: not a Horizon data manifest of format {FORMAT_VERSION}. {_FIX}")
  return manifest


def verify_shard(prepared_dir, shard: dict[str, Any], checksum: bool = True) -> epath.Path:
  """Checks a shard against its manifest entry; returns its path or raises DataError."""
  path = epath.Path(prepared_dir) / shard["file"]
  if not path.exists():
    raise DataError(f"{path}: shard listed in the manifest is missing. {_FIX}")
  try:
    reader = array_record_module.ArrayRecordReader(str(path))
    n = reader.num_records()
    first = reader.read([0])[0] if n else b""
    reader.close()
  except RuntimeError as e:
    raise DataError(f"{path}: corrupt shard, unreadable as ArrayRecord ({str(e)[:120]}). {_FIX}") from None
  if n and not first.startswith(RECORD_MAGIC):
    raise DataError(f"{path}: foreign shard: its records lack the {RECORD_MAGIC!r} magic, so it was not "
                    f"written by prepare_data. {_FIX}")
  if n != shard["records"]:
    raise DataError(f"{path}: has {n} records but the manifest says {shard['records']} (corrupt or "
                    f"replaced shard). {_FIX}")
  if checksum and _sha256(path) != shard["sha256"]:
    raise DataError(f"{path}: corrupt shard: sha256 does not match the manifest. {_FIX}")
  return path


def _source_dataset(prepared_dir, name: str, entry: dict, seed: int, process_index: int,
                    process_count: int, checksum: bool) -> grain.MapDataset:
  paths = [str(verify_shard(prepared_dir, s, checksum)) for s in entry["shards"]]
  if entry["documents"] < process_count:
    raise DataError(f"source {name} has {entry['documents']} documents, fewer than "
                    f"process_count={process_count}; each process needs its own documents.")
  ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths))
  ds = ds[process_index::process_count]
  return ds.shuffle(seed=seed).repeat().map(lambda r: _pair(decode_record(r, f"source {name}")))


def _source_seed(seed: int, name: str) -> int:
  """A per-source shuffle seed that does not change when other sources are added."""
  return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:4], "little")


def _pair(doc: np.ndarray) -> dict[str, np.ndarray]:
  """Document (ending in eos) -> next-token pair of length len(doc) - 1."""
  return {"inputs": doc[:-1], "targets": doc[1:]}


class _Pieces(grain.experimental.FlatMapTransform):
  """Cuts a pair into pieces of at most seq_len tokens (for first-fit packing)."""

  max_fan_out = sys.maxsize  # only the MapDataset flat-map uses it; we flat-map an IterDataset

  def __init__(self, seq_len: int):
    self.seq_len = seq_len

  def flat_map(self, pair):
    n = len(pair["inputs"])
    return [{k: v[a:a + self.seq_len] for k, v in pair.items()} for a in range(0, n, self.seq_len)]


def _final(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  seg = packed["inputs_segment_ids"].astype(np.int32)
  return {"inputs": packed["inputs"].astype(np.int32), "targets": packed["targets"].astype(np.int32),
          "positions": packed["inputs_positions"].astype(np.int32), "segment_ids": seg,
          "loss_mask": (seg > 0).astype(np.float32)}


def _mixture_weights(manifest: dict, weights: dict[str, float] | None) -> dict[str, float]:
  known = manifest["sources"]
  if weights is None:  # as written (a hand-edited "abc" or null is named below, not a bare error)
    weights = {name: e.get("weight") if isinstance(e, dict) else None for name, e in known.items()}
  unknown = sorted(set(weights) - set(known))
  if unknown:
    raise DataError(f"weights name unknown source(s) {unknown}; prepared sources: {sorted(known)}.")
  bad = {k: w for k, w in weights.items() if isinstance(w, bool) or not isinstance(w, (int, float, np.number))
         or not (np.isfinite(w) and w >= 0)}
  if bad:
    raise DataError(f"weights {bad}: each weight must be a finite number >= 0.")
  used = {k: float(w) for k, w in weights.items() if w > 0}
  if not used:
    raise DataError(f"weights {weights}: at least one source needs a weight > 0.")
  return used


def _document_rates(manifest: dict, used: dict[str, float], names: list[str]) -> list[float]:
  """Per source, the rate `MapDataset.mix` draws its documents at so that its share of the tokens
  is its weight: weight / mean tokens per document (a weight read as a share of documents gave a
  source of 9-token documents 2% of the tokens at weight 0.5 beside one of 400-token documents)."""
  entries = manifest["sources"]
  return [used[n] * entries[n]["documents"] / max(entries[n]["tokens"], 1) for n in names]


def make_lm_dataset(prepared_dir, weights: dict[str, float] | None, seq_len: int,
                    batch_size_per_process: int, seed: int, process_index: int = 0,
                    process_count: int = 1, packing: str = "concat", *, checksum: bool = True,
                    packing_bins: int | None = None, read_threads: int = 2) -> grain.IterDataset:
  """The packed, batched, infinite LM stream of this process (see module docstring).

  Yields dicts of numpy arrays [batch_size_per_process, seq_len]: inputs,
  targets, positions, segment_ids (int32) and loss_mask (float32). weights:
  source name -> weight (None: the manifest's weights; 0 drops a source).
  checksum: verify every used shard's sha256 first (record counts and the
  magic are always checked). packing_bins: first-fit bins (default: the
  batch size). `iter(ds)` has get_state() / set_state() for exact resume.
  """
  if packing not in PACKINGS:
    raise DataError(f"packing={packing!r}: choose one of {PACKINGS}.")
  for arg, v in (("seq_len", seq_len), ("batch_size_per_process", batch_size_per_process),
                 ("process_count", process_count)):
    if not isinstance(v, (int, np.integer)) or v < 1:
      raise DataError(f"make_lm_dataset: {arg}={v!r} must be a positive int.")
  if not 0 <= process_index < process_count:
    raise DataError(f"make_lm_dataset: process_index={process_index} must be in "
                    f"[0, process_count={process_count}).")
  if not is_int(seed, numpy=True) or seed < 0:
    raise DataError(f"make_lm_dataset: seed={seed!r} must be an int >= 0 (config.data.shuffle_seed).")
  manifest = load_manifest(prepared_dir)
  used = _mixture_weights(manifest, weights)
  names = sorted(used)
  parts = [_source_dataset(prepared_dir, n, manifest["sources"][n], _source_seed(seed, n),
                           process_index, process_count, checksum) for n in names]
  mixed = grain.MapDataset.mix(parts, _document_rates(manifest, used, names)) if len(parts) > 1 else parts[0]
  ds = mixed.to_iter_dataset(grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=64))
  lengths = {"inputs": int(seq_len), "targets": int(seq_len)}
  if packing == "concat":
    ds = grain.experimental.ConcatThenSplitIterDataset(ds, length_struct=lengths)
  else:
    ds = grain.experimental.FlatMapIterDataset(ds, _Pieces(int(seq_len)))
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct=lengths, num_packing_bins=packing_bins or batch_size_per_process,
        seed=seed, shuffle_bins=True)
  return _JsonState(ds.map(_final).batch(int(batch_size_per_process), drop_remainder=True))


def _tuples_in_slices(state: Any) -> Any:
  """Undoes JSON's tuple -> list on ConcatThenSplit's `remainder_slices`.

  grain 0.2.18 compares those slices with the tuple sentinel (-1, -1); a list
  [-1, -1] read back from JSON compares unequal and corrupts the resume.
  """
  if isinstance(state, dict):
    return {k: ({f: tuple(v) for f, v in s.items()} if k == "remainder_slices" else _tuples_in_slices(s))
            for k, s in state.items()}
  return state


class _JsonStateIterator(grain.DatasetIterator):
  def __init__(self, parent: grain.DatasetIterator):
    super().__init__(parent)

  def __next__(self):
    return next(self._parent)

  def get_state(self) -> dict[str, Any]:
    return self._parent.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(_tuples_in_slices(state))


class _JsonState(grain.IterDataset):
  """Makes the iterator state survive a JSON round trip (see _tuples_in_slices)."""

  def __iter__(self) -> grain.DatasetIterator:
    return _JsonStateIterator(self._parent.__iter__())
