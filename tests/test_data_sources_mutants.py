"""training/data_sources.py edge cases a mutation audit found unpinned: '=' and '@' inside a path,
a space before '=', a nan weight, one zero weight among others, directories matched by a glob, the
stdlib's site-packages, the jsonl field in the fingerprint, a stray byte in a text file, and
whitespace-only jsonl documents."""

import json

import pytest

from training import data_sources as ds


def test_equals_and_at_signs_inside_a_path():
  """The weight follows the last '='; only jsonl takes '@field' (mutants split at the first '=', and
  cut a text path at its '@')."""
  (src,) = ds.parse_sources("text:/data/k=v/*.md=0.5")
  assert (src.pattern, src.weight) == ("/data/k=v/*.md", 0.5)
  (src,) = ds.parse_sources("text:/data/team@x/*.md=2")
  assert (src.pattern, src.field, src.weight) == ("/data/team@x/*.md", "text", 2.0)
  (src,) = ds.parse_sources("text:/d/*.md =0.5")  # a space before '=' is not part of the glob
  assert (src.pattern, src.weight) == ("/d/*.md", 0.5)
  a, b = ds.parse_sources("text: /d/*.md=0.5; jsonl: /j/*.jsonl@body")  # nor a space after ':'
  assert (a.pattern, b.pattern, b.field) == ("/d/*.md", "/j/*.jsonl", "body")


def test_weights_nan_is_refused_and_one_zero_among_others_is_kept():
  with pytest.raises(ds.DataError, match=r"weight nan must be a finite number >= 0"):
    ds.parse_sources("stdlib=nan")
  got = ds.parse_sources("stdlib=0;text:/a/*.md=1")
  assert [(s.name, s.weight) for s in got] == [("stdlib", 0.0), ("text_0", 1.0)]


def test_a_directory_matching_the_glob_is_not_a_file(tmp_path):
  (tmp_path / "notes.txt").mkdir()  # a folder named like a file
  (tmp_path / "notes.txt" / "inner.md").write_text("x")
  (tmp_path / "a.txt").write_text("alpha")
  (src,) = ds.parse_sources(f"text:{tmp_path}/*.txt")
  assert [p.name for p in ds.source_files(src)] == ["a.txt"]
  assert list(ds.iter_documents(src)) == ["alpha"]


def test_stdlib_files_skip_site_packages(tmp_path, monkeypatch):
  """The stdlib source is the interpreter's own modules: installed packages under site-packages
  are left out (a mutant tested the file name instead of the path's folders)."""
  for rel in ("os.py", "json/decoder.py", "site-packages/pkg/mod.py", "site-packages/top.py"):
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_text("x = 1\n")
  monkeypatch.setattr(ds, "stdlib_root", lambda: ds.epath.Path(tmp_path))
  files = ds.source_files(ds.parse_sources("stdlib")[0])
  assert [str(p.relative_to(tmp_path)) for p in files] == ["json/decoder.py", "os.py"]


def test_the_jsonl_field_is_part_of_the_fingerprint(tmp_path):
  """Another field of the same files is other documents: prepared data must not be reused."""
  (tmp_path / "a.jsonl").write_text(json.dumps({"x": "one", "y": "two"}) + "\n")
  (x,) = ds.parse_sources(f"jsonl:{tmp_path}/*.jsonl@x")
  (y,) = ds.parse_sources(f"jsonl:{tmp_path}/*.jsonl@y")
  assert ds.input_fingerprint(x) != ds.input_fingerprint(y)
  assert ds.input_fingerprint(x) == ds.input_fingerprint(ds.parse_sources(f"jsonl:{tmp_path}/*.jsonl@x")[0])


def test_a_stray_byte_in_a_text_file_becomes_the_replacement_character(tmp_path):
  """(A mutant dropped it: the text then no longer matched the file.)"""
  (tmp_path / "a.txt").write_bytes(b"caf\xe9 au lait")
  (src,) = ds.parse_sources(f"text:{tmp_path}/*.txt")
  assert list(ds.iter_documents(src)) == ["caf\ufffd au lait"]


def test_whitespace_only_jsonl_documents_are_skipped(tmp_path):
  lines = [{"text": "first"}, {"text": " \n\t"}, {"text": ""}, {"text": "last"}]
  (tmp_path / "a.jsonl").write_text("".join(json.dumps(o) + "\n" for o in lines))
  (src,) = ds.parse_sources(f"jsonl:{tmp_path}/*.jsonl")
  assert list(ds.iter_documents(src)) == ["first", "last"]


def test_an_at_sign_in_a_jsonl_folder_is_part_of_the_path(tmp_path):
  """'@' followed by a '/' is a folder name, not the field: the rule used to cut the path there and
  read a field named 'x/*.jsonl'."""
  (src,) = ds.parse_sources("jsonl:/data/team@x/*.jsonl=2")
  assert (src.pattern, src.field, src.weight) == ("/data/team@x/*.jsonl", "text", 2.0)
  (src,) = ds.parse_sources("jsonl:/data/team@x/*.jsonl@body")
  assert (src.pattern, src.field) == ("/data/team@x/*.jsonl", "body")
  folder = tmp_path / "team@x"
  folder.mkdir()
  (folder / "a.jsonl").write_text(json.dumps({"text": "one"}) + "\n")
  (src,) = ds.parse_sources(f"jsonl:{folder}/*.jsonl")
  assert list(ds.iter_documents(src)) == ["one"]


def test_a_local_glob_may_start_at_home(tmp_path, monkeypatch):
  """A quoted '--data_sources=text:~/notes/*.md' reaches the program with '~' unexpanded."""
  monkeypatch.setenv("HOME", str(tmp_path))
  (tmp_path / "notes").mkdir()
  (tmp_path / "notes" / "a.md").write_text("alpha")
  (src,) = ds.parse_sources("text:~/notes/*.md")
  assert src.pattern == "~/notes/*.md"  # the spec as written (what the data's metadata records)
  assert [str(p) for p in ds.source_files(src)] == [str(tmp_path / "notes" / "a.md")]
  assert list(ds.iter_documents(src)) == ["alpha"]
