"""training/data.py: source specs, prepare (manifest, no-op, damage), grain pipeline."""

import json
import os

import numpy as np
import pytest
from array_record.python import array_record_module

from training import batch_checks, data
from training.tokenizer import default_tokenizer_path, load_tokenizer

_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
          "november oscar papa quebec romeo sierra tango uniform victor whiskey xray").split()


@pytest.fixture(scope="module")
def tok():
  return load_tokenizer(default_tokenizer_path("tiny"))


class _OtherTokenizer:
  """The same ids under another fingerprint (stands for a retrained tokenizer)."""

  def __init__(self, tok):
    self._tok, self.eos_id, self.vocab_size = tok, tok.eos_id, tok.vocab_size
    self.fingerprint = "another-" + tok.fingerprint

  def encode(self, text):
    return self._tok.encode(text)


def _write_docs(folder, n, seed, min_words=3, max_words=30, words=_WORDS):
  folder.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(seed)
  for i in range(n):
    k = int(rng.integers(min_words, max_words + 1))
    text = f"doc {seed}-{i}: " + " ".join(rng.choice(words, k)) + "\n"
    (folder / f"d{i:03d}.txt").write_text(text)
  return folder


def _doc_tokens(tok, source):
  return [np.asarray(tok.encode(t) + [tok.eos_id]) for t in data.iter_documents(source)]


def _file_mtimes(root):
  return {p: os.stat(p).st_mtime_ns for p in map(str, sorted(root.rglob("*")))}


def _segments(batch):
  """(row, inputs, targets) of every packed segment."""
  for r in range(batch["inputs"].shape[0]):
    seg = batch["segment_ids"][r]
    for s in np.unique(seg[seg > 0]):
      where = seg == s
      yield r, batch["inputs"][r][where], batch["targets"][r][where]


def _owner_docs(inputs, targets, docs):
  """Indices of the docs in which inputs + last target is a contiguous run (the pair rule)."""
  run = np.concatenate([inputs, targets[-1:]])
  found = []
  for i, d in enumerate(docs):
    for a in range(len(d) - len(run) + 1):
      if np.array_equal(d[a:a + len(run)], run) and np.array_equal(d[a + 1:a + len(run)], targets):
        found.append(i)
        break
  return found


def _same(a, b):
  return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)


# ---- sources -------------------------------------------------------------------


def test_parse_sources():
  got = data.parse_sources(
      "stdlib=0.7; text:/d/*.md=0.2;jsonl:/d/x.jsonl@body=0.1;text:/e/*=2;jsonl:/f.jsonl")
  assert [s.name for s in got] == ["stdlib", "text_0", "jsonl_0", "text_1", "jsonl_1"]
  assert got[0] == data.Source("stdlib", "stdlib", "", "text", 0.7)
  assert (got[2].pattern, got[2].field, got[2].weight) == ("/d/x.jsonl", "body", 0.1)
  assert (got[4].field, got[4].weight) == ("text", 1.0)


@pytest.mark.parametrize("spec, needle", [
    ("", "empty"), ("stdlib;;text:/a=1", "stray ';'"), ("book:/a=1", "unknown kind 'book'"),
    ("stdlib=lots", "'lots'"), ("text:/a=-1", ">= 0"), ("stdlib:/x=1", "takes no path"),
    ("text=1", "missing path"), ("stdlib=1;stdlib=2", "twice"), ("jsonl:/a.jsonl@=1", "empty field"),
    ("stdlib=0;text:/a=0", "every weight is 0"),
])
def test_parse_sources_errors(spec, needle):
  with pytest.raises(data.DataError, match=None) as e:
    data.parse_sources(spec)
  assert needle in str(e.value)


def test_jsonl_documents_and_errors(tmp_path):
  good = tmp_path / "a.jsonl"
  good.write_text(json.dumps({"body": "first"}) + "\n\n" + json.dumps({"body": "second", "x": 1}) + "\n")
  src = data.parse_sources(f"jsonl:{tmp_path}/*.jsonl@body=1")[0]
  assert list(data.iter_documents(src)) == ["first", "second"]
  (tmp_path / "b.jsonl").write_text(json.dumps({"text": "no body"}) + "\n")
  with pytest.raises(data.DataError, match=r"b.jsonl:1: no string field 'body'"):
    list(data.iter_documents(src))
  with pytest.raises(data.DataError, match="no file matches"):
    data.source_files(data.parse_sources(f"text:{tmp_path}/*.none")[0])


@pytest.mark.parametrize("line, why", [
  (b'{"body": "a", "n": 1' + b"0" * 5000 + b"}", "Exceeds the limit"),
  (b'{"body": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "maximum recursion depth"),
  (b'{"body": "a"', "Expecting ',' delimiter"),
])
def test_a_jsonl_line_python_cannot_read_names_its_file_and_line(tmp_path, line, why):
  """Valid JSON that Python's json refuses (a 5001-digit number, deep nesting) ended the corpus read
  with a bare ValueError / RecursionError, without the file or line."""
  (tmp_path / "c.jsonl").write_bytes(b'{"body": "ok"}\n' + line + b"\n")
  src = data.parse_sources(f"jsonl:{tmp_path}/*.jsonl@body=1")[0]
  with pytest.raises(data.DataError, match=rf"c.jsonl:2: not valid JSON \({why}"):
    list(data.iter_documents(src))


def test_a_stray_byte_in_a_jsonl_corpus_is_replaced_as_in_text_files(tmp_path):
  """A byte that is not UTF-8 ended the whole corpus with UnicodeDecodeError (text files replace it)."""
  (tmp_path / "c.jsonl").write_bytes(b'{"body": "caf\xe9 au lait"}\n{"body": "two"}\n')
  src = data.parse_sources(f"jsonl:{tmp_path}/*.jsonl@body=1")[0]
  assert list(data.iter_documents(src)) == ["caf\ufffd au lait", "two"]


# ---- prepare -------------------------------------------------------------------


def test_prepare_leaves_files_it_did_not_write_alone(tmp_path, tok):
  """It deleted a folder named like a source and replaced a foreign manifest.json."""
  src = data.parse_sources("stdlib=1.0")[0]
  out = tmp_path / "mine"
  (out / "stdlib").mkdir(parents=True)
  (out / "stdlib" / "notes.txt").write_text("keep me")
  (out / data.MANIFEST_NAME).write_text('{"mine": true}')
  with pytest.raises(data.DataError, match=r"holds 'manifest.json', 'stdlib', which prepare did not write"):
    data.prepare([src], tok, out, max_docs=2, log=lambda s: None)
  assert (out / "stdlib" / "notes.txt").read_text() == "keep me"
  assert (out / data.MANIFEST_NAME).read_text() == '{"mine": true}'
  ours = tmp_path / "ours"
  data.prepare([src], tok, ours, max_docs=2, log=lambda s: None)
  assert data.prepare([src], tok, ours, max_docs=2, log=lambda s: None)["up_to_date"]  # its own: kept
  missing = data.parse_sources(f"stdlib=1;text:{tmp_path}/none/*.md=1")
  with pytest.raises(data.DataError, match="no file matches"):  # before stdlib is tokenized
    data.prepare(missing, tok, tmp_path / "new", max_docs=2, log=lambda s: None)
  assert not (tmp_path / "new" / "stdlib").exists()


def test_prepare_counts_match_retokenized_docs(tmp_path, tok):
  src = data.parse_sources("stdlib=1.0")[0]
  m = data.prepare([src], tok, tmp_path / "p", docs_per_shard=3, max_docs=7, log=lambda s: None)
  docs = [tok.encode(t) for _, t in zip(range(7), data.iter_documents(src), strict=False)]
  entry = m["sources"]["stdlib"]
  assert entry["documents"] == 7 and entry["tokens"] == sum(len(d) + 1 for d in docs)
  assert [s["records"] for s in entry["shards"]] == [3, 3, 1]
  assert entry["shards"][0]["file"] == "stdlib/shard-00000-of-00003.arrayrecord"
  assert m["tokenizer"]["fingerprint"] == tok.fingerprint and not m["up_to_date"]
  records = []
  for s in entry["shards"]:
    reader = array_record_module.ArrayRecordReader(str(tmp_path / "p" / s["file"]))
    records += [data.decode_record(r) for r in reader.read_all()]
    reader.close()
  assert [r.tolist() for r in records] == [d + [tok.eos_id] for d in docs]
  assert json.loads((tmp_path / "p" / data.MANIFEST_NAME).read_text())["sources"]["stdlib"] == entry


def test_rerun_is_noop_and_changes_rebuild(tmp_path, tok):
  a, b = _write_docs(tmp_path / "a", 5, seed=1), _write_docs(tmp_path / "b", 5, seed=2)
  out = tmp_path / "p"
  srcs = data.parse_sources(f"text:{a}/*.txt=1;text:{b}/*.txt=1")
  logs = []
  data.prepare(srcs, tok, out, docs_per_shard=2, log=logs.append)
  before = _file_mtimes(out)
  m = data.prepare(srcs, tok, out, docs_per_shard=2, log=logs.append)
  assert m["up_to_date"] and m["rebuilt"] == [] and logs[-1].endswith("up to date")
  assert _file_mtimes(out) == before
  (a / "d002.txt").write_text("a changed document with other words\n")
  m = data.prepare(srcs, tok, out, docs_per_shard=2, log=logs.append)
  assert m["rebuilt"] == ["text_0"] and not m["up_to_date"]
  m = data.prepare(srcs, _OtherTokenizer(tok), out, docs_per_shard=2, log=logs.append)
  assert m["rebuilt"] == ["text_0", "text_1"]


def _prepared_text(tmp_path, tok, n=12):
  _write_docs(tmp_path / "a", n, seed=3)
  out = tmp_path / "p"
  data.prepare(data.parse_sources(f"text:{tmp_path}/a/*.txt=1"), tok, out, docs_per_shard=5,
               log=lambda s: None)
  return out, json.loads((out / data.MANIFEST_NAME).read_text())["sources"]["text_0"]["shards"]


def _open(out, **kw):
  return data.make_lm_dataset(out, None, seq_len=16, batch_size_per_process=2, seed=0, **kw)


def test_corrupt_shard_is_a_clear_error(tmp_path, tok):
  out, shards = _prepared_text(tmp_path, tok)
  next(iter(_open(out)))
  path = out / shards[1]["file"]
  raw = bytearray(path.read_bytes())
  raw[len(raw) // 3] ^= 0xFF
  path.write_bytes(bytes(raw))
  with pytest.raises(data.DataError, match=r"shard-00001-of-00003.arrayrecord: corrupt shard.*re-run"):
    _open(out)


def test_foreign_shard_is_a_clear_error(tmp_path, tok):
  out, shards = _prepared_text(tmp_path, tok)
  path = out / shards[0]["file"]
  writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
  for i in range(shards[0]["records"]):
    writer.write(f"someone else's record {i}".encode())
  writer.close()
  with pytest.raises(data.DataError, match=r"shard-00000-of-00003.arrayrecord: foreign shard.*prepare_data"):
    _open(out)
  with pytest.raises(data.DataError, match="foreign record"):
    data.decode_record(b"TFR0\x01\x00\x00\x00")


def test_missing_or_interrupted_prepare_is_a_clear_error(tmp_path, tok):
  out, _ = _prepared_text(tmp_path, tok)
  (out / data.MANIFEST_NAME).unlink()
  with pytest.raises(data.DataError, match="not prepared.*prepare_data"):
    _open(out)
  (out / data.MANIFEST_NAME).write_text(json.dumps({"format": 99}))
  with pytest.raises(data.DataError, match="not a Horizon data manifest"):
    _open(out)


# ---- pipeline ------------------------------------------------------------------


def test_mixture_weights_are_honoured(tmp_path, tok):
  # Equal-length docs made of disjoint letters, so token shares equal doc shares.
  for name, letter in (("a", "x"), ("b", "q")):
    (tmp_path / name).mkdir()
    for i in range(30):
      (tmp_path / name / f"{i}.txt").write_text((letter + " ") * 24)
  out = tmp_path / "p"
  data.prepare(data.parse_sources(f"text:{tmp_path}/a/*=0.5;text:{tmp_path}/b/*=0.5"), tok, out,
               log=lambda s: None)
  x_ids = list(set(tok.encode("x x ")) - set(tok.encode("q q ")))
  q_ids = list(set(tok.encode("q q ")) - set(tok.encode("x x ")))
  for weights, want in ((None, 0.5), ({"text_0": 0.8, "text_1": 0.2}, 0.8),
                        ({"text_0": 0.0, "text_1": 1}, 0.0)):
    it = iter(data.make_lm_dataset(out, weights, 32, 8, seed=5))
    toks = np.concatenate([next(it)["inputs"].ravel() for _ in range(25)])
    from_a = np.isin(toks, x_ids).sum() / np.isin(toks, x_ids + q_ids).sum()
    assert abs(from_a - want) < 0.03, (weights, from_a)
  with pytest.raises(data.DataError, match=r"unknown source\(s\) \['web'\]"):
    data.make_lm_dataset(out, {"web": 1.0}, 32, 8, seed=5)


@pytest.fixture(scope="module")
def varied(tmp_path_factory, tok):
  """40 docs of 3..30 words; (prepared dir, their token arrays with eos)."""
  root = tmp_path_factory.mktemp("varied")
  _write_docs(root / "docs", 40, seed=7)
  src = data.parse_sources(f"text:{root}/docs/*.txt=1")
  data.prepare(src, tok, root / "p", docs_per_shard=16, log=lambda s: None)
  return root / "p", _doc_tokens(tok, src[0])


@pytest.mark.parametrize("packing", data.PACKINGS)
def test_packing_is_consistent(varied, tok, packing):
  out, docs = varied
  it = iter(data.make_lm_dataset(out, None, seq_len=37, batch_size_per_process=3, seed=1, packing=packing))
  padding = 0
  for _ in range(12):
    batch = next(it)
    assert batch["inputs"].shape == (3, 37) and batch["inputs"].dtype == np.int32
    batch_checks.check_batch(batch, tok.eos_id, docs_end_in_row=packing == "concat")
    for _, inputs, targets in _segments(batch):
      assert _owner_docs(inputs, targets, docs), "a segment is not a contiguous piece of any document"
    padding += int((batch["segment_ids"] == 0).sum())
  assert (padding > 0) == (packing == "first_fit")
  # The check can fail: shifted positions, a target from another segment, eos inside a segment.
  for key, edit in (("positions", lambda b: b.__setitem__((0, 5), b[0, 5] + 1)),
                    ("targets", lambda b: b.__setitem__((1, 3), (b[1, 3] + 1) % 300)),
                    ("inputs", lambda b: b.__setitem__((2, 4), tok.eos_id))):
    bad = {k: v.copy() for k, v in batch.items()}
    edit(bad[key])
    with pytest.raises(data.DataError, match="batch row"):
      batch_checks.check_batch(bad, tok.eos_id)


@pytest.mark.parametrize("packing", data.PACKINGS)
def test_exact_resume(varied, packing):
  out, _ = varied
  ds = data.make_lm_dataset(out, None, seq_len=29, batch_size_per_process=3, seed=11, packing=packing)
  it = iter(ds)
  start = json.dumps(it.get_state())
  first = [next(it) for _ in range(7)]
  state = json.dumps(it.get_state())
  want = [next(it) for _ in range(5)]
  for saved, expect in ((state, want), (start, first + want)):
    fresh = iter(data.make_lm_dataset(out, None, seq_len=29, batch_size_per_process=3, seed=11,
                                      packing=packing))
    fresh.set_state(json.loads(saved))
    assert _same([next(fresh) for _ in range(len(expect))], expect)
  other = iter(data.make_lm_dataset(out, None, seq_len=29, batch_size_per_process=3, seed=12,
                                    packing=packing))
  assert not _same([next(other) for _ in range(7)], first)


def test_processes_read_disjoint_documents(varied):
  out, docs = varied
  seen = []
  for p in range(2):
    it = iter(data.make_lm_dataset(out, None, 31, 2, seed=3, process_index=p, process_count=2))
    again = iter(data.make_lm_dataset(out, None, 31, 2, seed=3, process_index=p, process_count=2))
    batches = [next(it) for _ in range(40)]
    assert _same(batches, [next(again) for _ in range(40)])
    owners = set()
    for b in batches:
      for _, inputs, targets in _segments(b):
        found = _owner_docs(inputs, targets, docs)
        assert found
        if len(found) == 1:
          owners.add(found[0])
    seen.append(owners)
  assert not seen[0] & seen[1]
  assert seen[0] | seen[1] == set(range(40))  # ~1.2 epochs each: every doc identified
  with pytest.raises(data.DataError, match=r"process_index=2 must be in \[0, process_count=2\)"):
    data.make_lm_dataset(out, None, 31, 2, seed=3, process_index=2, process_count=2)


def test_prepare_data_launcher_and_noop_rerun(tmp_path):
  import subprocess
  import sys
  from pathlib import Path

  root = Path(__file__).resolve().parents[1]
  _write_docs(tmp_path / "docs", 4, seed=8)
  cmd = [sys.executable, "-m", "experiments.prepare_data", "--config=configs/pretrain.py:tiny",
         f"--sources=stdlib=0.9;text:{tmp_path}/docs/*.txt=0.1", "--max_docs=3", f"--out={tmp_path}/p"]
  runs = [subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300) for _ in range(2)]
  for r in runs:
    assert r.returncode == 0, r.stderr[-2000:]
  first, second = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
  assert first["sources"]["stdlib"]["documents"] == 3 and first["sources"]["text_0"]["weight"] == 0.1
  assert not first["up_to_date"] and second["up_to_date"] and second["sources"] == first["sources"]
  assert "stdlib: 3 docs" in runs[0].stdout
