"""training/data.py edge cases that mutation testing found unpinned: piece cutting for first-fit
packing, the process/document boundary, argument checks, ragged records, damaged shards on
re-run, a weight-only change, and the default number of first-fit bins."""

import json

import numpy as np
import pytest
from array_record.python import array_record_module
from etils import epath

from training import data
from training.tokenizer import default_tokenizer_path, load_tokenizer


@pytest.fixture(scope="module")
def tok():
  return load_tokenizer(default_tokenizer_path("tiny"))


def _docs(folder, n, seed):
  folder.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(seed)
  words = "kilo lima mike oscar papa quebec romeo sierra tango victor".split()
  for i in range(n):
    k = int(rng.integers(3, 19))
    (folder / f"d{i:02d}.txt").write_text(f"doc {i}: " + " ".join(rng.choice(words, k)))
  return folder


@pytest.mark.parametrize("n, seq_len, lengths", [
    (1, 3, [1]), (3, 3, [3]), (4, 3, [3, 1]), (7, 3, [3, 3, 1]), (11, 5, [5, 5, 1]), (10, 5, [5, 5])])
def test_pieces_cover_the_pair_in_order(n, seq_len, lengths):
  rng = np.random.default_rng(n * 31 + seq_len)
  doc = rng.integers(0, 300, n + 1).astype(np.int32)
  pieces = data._Pieces(seq_len).flat_map({"inputs": doc[:-1], "targets": doc[1:]})
  assert [len(p["inputs"]) for p in pieces] == lengths
  assert [len(p["targets"]) for p in pieces] == lengths
  np.testing.assert_array_equal(np.concatenate([p["inputs"] for p in pieces]), doc[:-1])
  np.testing.assert_array_equal(np.concatenate([p["targets"] for p in pieces]), doc[1:])


def test_as_many_documents_as_processes_is_enough(tmp_path, tok):
  _docs(tmp_path / "a", 3, seed=4)
  out = tmp_path / "p"
  data.prepare(data.parse_sources(f"text:{tmp_path}/a/*.txt=1"), tok, out, log=lambda s: None)
  batch = next(iter(data.make_lm_dataset(out, None, 13, 2, seed=1, process_index=2, process_count=3)))
  assert batch["inputs"].shape == (2, 13)
  with pytest.raises(data.DataError, match="has 3 documents, fewer than process_count=4"):
    data.make_lm_dataset(out, None, 13, 2, seed=1, process_index=0, process_count=4)


@pytest.mark.parametrize("arg", ["seq_len", "batch_size_per_process", "process_count"])
def test_zero_sizes_are_rejected_by_name(tmp_path, arg):
  kw = {"seq_len": 13, "batch_size_per_process": 2, "process_count": 1, arg: 0}
  with pytest.raises(data.DataError, match=f"{arg}=0 must be a positive int"):
    data.make_lm_dataset(tmp_path, None, seed=0, **kw)


def test_ragged_record_is_foreign():
  with pytest.raises(data.DataError, match="foreign record"):
    data.decode_record(data.RECORD_MAGIC + b"\x01\x00\x00\x00\x02\x00")
  np.testing.assert_array_equal(data.decode_record(data.RECORD_MAGIC + b"\x07\x00\x00\x00\x01\x01\x00\x00"),
                                [7, 257])


@pytest.fixture
def prepared(tmp_path, tok):
  _docs(tmp_path / "a", 9, seed=6)
  out = tmp_path / "p"
  srcs = data.parse_sources(f"text:{tmp_path}/a/*.txt=1")
  data.prepare(srcs, tok, out, docs_per_shard=4, log=lambda s: None)
  shards = json.loads((out / data.MANIFEST_NAME).read_text())["sources"]["text_0"]["shards"]
  return tmp_path, out, shards


def test_shard_with_fewer_records_is_named(prepared):
  _, out, shards = prepared
  path = out / shards[0]["file"]
  writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
  for i in range(shards[0]["records"] - 1):
    writer.write(data.encode_record([5, i, 9]))
  writer.close()
  with pytest.raises(data.DataError, match=r"shard-00000-of-00003.arrayrecord: has 3 records but the "
                                           r"manifest says 4"):
    data.make_lm_dataset(out, None, 13, 2, seed=0)


def test_rerun_rebuilds_a_shard_whose_size_changed(prepared, tok):
  tmp_path, out, shards = prepared
  path = out / shards[2]["file"]
  path.write_bytes(path.read_bytes() + b"junk")
  srcs = data.parse_sources(f"text:{tmp_path}/a/*.txt=1")
  m = data.prepare(srcs, tok, out, docs_per_shard=4, log=lambda s: None)
  assert m["rebuilt"] == ["text_0"] and not m["up_to_date"]
  assert path.stat().st_size == shards[2]["bytes"]
  assert next(iter(data.make_lm_dataset(out, None, 13, 2, seed=0)))["inputs"].shape == (2, 13)


def test_weight_only_change_rewrites_the_manifest(prepared, tok):
  tmp_path, out, _ = prepared
  m = data.prepare(data.parse_sources(f"text:{tmp_path}/a/*.txt=0.25"), tok, out, docs_per_shard=4,
                   log=lambda s: None)
  assert m["rebuilt"] == [] and not m["up_to_date"]
  assert data.load_manifest(out)["sources"]["text_0"]["weight"] == 0.25


def test_first_fit_bins_default_to_the_batch_size(tmp_path, tok):
  _docs(tmp_path / "a", 20, seed=8)
  out = tmp_path / "p"
  data.prepare(data.parse_sources(f"text:{tmp_path}/a/*.txt=1"), tok, out, log=lambda s: None)

  def stream(**kw):
    it = iter(data.make_lm_dataset(out, None, 29, 3, seed=2, packing="first_fit", **kw))
    return [next(it) for _ in range(6)]

  default, three, one = stream(), stream(packing_bins=3), stream(packing_bins=1)
  assert all(np.array_equal(a[k], b[k]) for a, b in zip(default, three, strict=True) for k in a)
  assert not all(np.array_equal(a[k], b[k]) for a, b in zip(default, one, strict=True) for k in a)


# ---- sources -------------------------------------------------------------------


def test_whitespace_only_text_documents_are_skipped(tmp_path):
  (tmp_path / "a.txt").write_text("  \n\t\n")
  (tmp_path / "b.txt").write_text(" real text \n")
  (tmp_path / "c.txt").write_text("")
  src = data.parse_sources(f"text:{tmp_path}/*.txt=1")[0]
  assert list(data.iter_documents(src)) == [" real text \n"]


def test_jsonl_field_is_after_the_last_at():
  (src,) = data.parse_sources("jsonl:/data/team@x/*.jsonl@body=0.5")
  assert (src.pattern, src.field, src.weight) == ("/data/team@x/*.jsonl", "body", 0.5)


def test_same_size_edit_with_a_new_mtime_rebuilds(tmp_path, tok):
  import os

  folder = _docs(tmp_path / "a", 3, seed=9)
  srcs = data.parse_sources(f"text:{folder}/*.txt=1")
  out = tmp_path / "p"
  data.prepare(srcs, tok, out, log=lambda s: None)
  doc = folder / "d01.txt"
  text = doc.read_text()
  st = os.stat(doc)
  doc.write_text(text[::-1])  # same size, other content
  os.utime(doc, ns=(st.st_atime_ns, st.st_mtime_ns + 7_000_000_000))
  m = data.prepare(srcs, tok, out, log=lambda s: None)
  assert m["rebuilt"] == ["text_0"]


def test_weights_are_shares_of_the_tokens_not_of_the_documents(tmp_path, tok):
  """Two sources at weight 0.5, one of 9-token documents and one of ~400: the short one got 2% of
  the trained tokens (documents were drawn 1:1). Now each gets half of the tokens."""
  for name, letter, words in (("a", "x", 4), ("b", "q", 200)):
    (tmp_path / name).mkdir()
    for i in range(40):
      (tmp_path / name / f"{i}.txt").write_text((letter + " ") * words)
  out = tmp_path / "p"
  data.prepare(data.parse_sources(f"text:{tmp_path}/a/*=0.5;text:{tmp_path}/b/*=0.5"), tok, out,
               log=lambda s: None)
  x_ids = list(set(tok.encode("x x ")) - set(tok.encode("q q ")))
  q_ids = list(set(tok.encode("q q ")) - set(tok.encode("x x ")))
  it = iter(data.make_lm_dataset(out, None, 64, 8, seed=0))
  toks = np.concatenate([next(it)["inputs"].ravel() for _ in range(50)])
  from_a = np.isin(toks, x_ids).sum() / np.isin(toks, x_ids + q_ids).sum()
  assert abs(from_a - 0.5) < 0.05, from_a


def test_a_glob_over_the_output_and_a_doubled_star_read_each_file_once(tmp_path, tok):
  """`text:D/**` with the output under D tokenized the previous run's shards and manifest as text
  (rebuilt on every run, never up to date); `**/**` listed a file once per way of matching it."""
  docs = tmp_path / "D"
  (docs / "a").mkdir(parents=True)
  (docs / "x.txt").write_text("one two three\n")
  (docs / "a" / "y.txt").write_text("four five\n")
  assert [p.name for p in data.source_files(data.parse_sources(f"text:{docs}/**/**/*.txt")[0])] == [
      "y.txt", "x.txt"]
  sources = data.parse_sources(f"text:{docs}/**")
  first = data.prepare(sources, tok, docs / "p", log=lambda s: None)
  again = data.prepare(sources, tok, docs / "p", log=lambda s: None)
  assert first["sources"]["text_0"]["documents"] == 2 and again["up_to_date"], again


@pytest.mark.parametrize("seed", [-1, 0.5, True])
def test_a_shuffle_seed_that_is_not_an_int_is_named_first(prepared, seed):
  """-1 and 0.5 started the pipeline and failed at the first batch (first_fit) or were taken as
  they came (concat)."""
  with pytest.raises(data.DataError, match=r"seed=.* must be an int >= 0 \(config.data.shuffle_seed\)"):
    data.make_lm_dataset(prepared[1], None, 32, 2, seed=seed, packing="first_fit")


def test_a_rebuild_killed_while_removing_the_old_folder_restarts(tmp_path, tok, monkeypatch):
  """The old source folder was removed in place: a kill after its source.json went left a folder
  the next prepare refused as not its own, so a preempted launch could not restart."""
  _docs(tmp_path / "a", 5, seed=1)
  out, srcs = tmp_path / "p", data.parse_sources(f"text:{tmp_path}/a/*.txt=1")
  data.prepare(srcs, tok, out, log=lambda s: None)
  (tmp_path / "a" / "new.txt").write_text("a changed input rebuilds the source\n")
  cls = type(epath.Path(out))
  real = cls.rmtree

  def killed(self, *args, **kwargs):
    if (self / data.SOURCE_META_NAME).exists():
      (self / data.SOURCE_META_NAME).unlink()
      raise KeyboardInterrupt  # the kill, mid-removal
    return real(self, *args, **kwargs)

  monkeypatch.setattr(cls, "rmtree", killed)
  with pytest.raises(KeyboardInterrupt):
    data.prepare(srcs, tok, out, log=lambda s: None)
  monkeypatch.undo()
  again = data.prepare(srcs, tok, out, log=lambda s: None)
  assert again["sources"]["text_0"]["documents"] == 6 and sorted(p.name for p in out.iterdir()) == [
      data.MANIFEST_NAME, "text_0"]


@pytest.mark.parametrize("weight", ["abc", None, "0.5", True])
def test_a_weight_that_is_not_a_number_is_named(prepared, weight):
  """A hand-edited manifest weight "abc" or null, or weights={'text_0': '1'}, raised a bare
  ValueError / TypeError; the string "0.5" was taken as a number."""
  _, out, _ = prepared
  manifest = json.loads((out / data.MANIFEST_NAME).read_text())
  manifest["sources"]["text_0"]["weight"] = weight
  (out / data.MANIFEST_NAME).write_text(json.dumps(manifest))
  for weights in (None, {"text_0": weight}):
    with pytest.raises(data.DataError, match=r"each weight must be a finite number >= 0"):
      data.make_lm_dataset(out, weights, 32, 2, seed=0)


def test_a_jsonl_field_that_is_not_there_fails_before_any_source_is_tokenized(tmp_path, tok):
  """The first source was tokenized in full before the second one's wrong @field was found."""
  _docs(tmp_path / "a", 3, seed=2)
  (tmp_path / "x.jsonl").write_text('{"text": "a document"}\n')
  srcs = data.parse_sources(f"text:{tmp_path}/a/*.txt=1;jsonl:{tmp_path}/x.jsonl@content=1")
  with pytest.raises(data.DataError, match=r"x.jsonl:1: no string field 'content'"):
    data.prepare(srcs, tok, tmp_path / "p", log=lambda s: None)
  assert not (tmp_path / "p" / "text_0").exists()
