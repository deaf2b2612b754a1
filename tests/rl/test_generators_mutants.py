"""Mutation audit of the shared generator plumbing (rl/tasks/generators/common.py) and of the docqa and
terminal generators: RNG seeds and split hashes by the formula the module docstring states, ids, the
levels' question kinds and templates, and tasks that ask for a real change (each test names the mistake
it catches)."""

import hashlib
import random
import re
import shutil
import subprocess

import numpy as np
import pytest

from rl.tasks import generators
from rl.tasks.generators import cad, common, docqa, terminal
from rl.tasks.schema import DOMAINS


def _sha(*parts):
  return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:8], "little")


# ---- common: seeds, splits, ids, arguments ------------------------------------------------------


def test_a_task_rng_is_seeded_by_domain_split_level_seed_and_index():
  """Catches a part dropped from the seed (the two splits, or two levels, sharing one RNG) and a
  shortened hash (256 seeds in all)."""
  for args in [("cad", "train", 2, 7, 3), ("cad", "heldout", 2, 7, 3), ("docqa", "train", 0, 0, 0),
               ("terminal", "heldout", 3, 11, 41), ("terminal", "heldout", 1, 11, 41)]:
    want = random.Random(_sha("task", *args)).random()
    assert common.task_rng(*args).random() == want, args


def test_a_quarter_of_instances_are_held_out_by_their_key_hash():
  """Catches the comparison flipped (three quarters held out) and another held-out fraction."""
  keys = [("docqa-company", f"Name {i}") for i in range(4000)]
  got = [common.split_of(k) for k in keys]
  want = ["heldout" if _sha("split", k) % 10_000 < 2_500 else "train" for k in keys]
  assert got == want
  assert 0.22 < got.count("heldout") / len(got) < 0.28


def test_ids_and_meta_name_the_split_level_seed_and_index():
  """Catches the split left out of the id (a train and a held-out task with one id), an id index
  that stops sorting past 9999, and the seed missing from the meta."""
  task = terminal.generate(split="heldout", difficulty=2, n=4, seed=7)[3]
  assert task.id == "terminal-heldout-d2-s7-00003"
  assert common.task_id("cad", "train", 0, 12, 12345) == "cad-train-d0-s12-12345"
  assert {k: task.meta[k] for k in ("generator", "split", "difficulty", "seed")} == {
    "generator": "terminal", "split": "heldout", "difficulty": 2, "seed": 7}


@pytest.mark.parametrize("mod", [cad, docqa, terminal], ids=lambda m: m.DOMAIN)
def test_bad_levels_splits_and_seeds_are_refused_up_front(mod):
  """Catches the top level + 1 or -1 let through (an IndexError deep in a template, or the top level's
  templates under a `d-1` id). A NumPy seed reached the tasks' meta, where writing the tasks failed in
  json.dumps; a seed of 1.5 gave ids with `-s1.5-`."""
  top = mod.MAX_DIFFICULTY
  for kw, says in [(dict(difficulty=top + 1), rf"in 0\.\.{top}; got {top + 1}"),
                   (dict(difficulty=-1), rf"in 0\.\.{top}; got -1"),
                   (dict(split="test"), "split must be one of train, heldout; got 'test'"),
                   (dict(seed=np.int64(3)), r"seed for \w+ must be a Python int.*got np\.int64\(3\)"),
                   (dict(seed=1.5), r"seed for \w+ must be a Python int.*got 1\.5"),
                   (dict(seed=True), r"seed for \w+ must be a Python int.*got True")]:
    with pytest.raises(ValueError, match=says):
      mod.generate(**{"split": "train", "difficulty": 0, "n": 1, "seed": 0, **kw})
  task = mod.generate(split="train", difficulty=top, n=1, seed=0)[0]
  assert task.id == f"{mod.DOMAIN}-train-d{top}-s0-00000"


@pytest.mark.parametrize("domain", DOMAINS)
def test_every_domain_refuses_a_negative_or_fractional_count(domain):
  """A per-domain `generate` returned [] for n=-1 and raised a TypeError deep in its loop for 1.5;
  both are refused naming n (the public generators.generate refuses n < 1 as well); 0 is no tasks."""
  mod = generators.module(domain)
  for n in (-1, 1.5, True):
    with pytest.raises(ValueError, match=rf"n \(the number of {domain} tasks\) must be an integer >= 0; "
                                         rf"got {n}"):
      mod.generate(split="train", difficulty=0, n=n, seed=0)
  assert mod.generate(split="train", difficulty=0, n=0, seed=0) == []


# ---- docqa -------------------------------------------------------------------------------------

# The question kinds of each level, as the module docstring lists them, by the question's opening.
DOCQA_LEVELS = {
  0: ("What was {item} in",),
  1: ("By what percentage did", "What was the gross margin", "What was the operating margin",
      "What was the net margin", "By how much did"),
  2: ("What was the current ratio", "What was the ratio of total liabilities", "What was the return on "
      "equity", "What was the effective tax rate", "What were the earnings per share", "What was the total"),
  3: ("What was the compound annual growth", "What was the average net margin", "By how many percentage "
      "points", "What share of", "What was the return on average equity", "What was the interest coverage"),
}


@pytest.fixture(scope="module")
def docqa_tasks():
  return {level: docqa.generate(split="train", difficulty=level, n=40, seed=5) for level in DOCQA_LEVELS}


def test_each_docqa_level_asks_its_own_kinds_of_question(docqa_tasks):
  """Catches a question kind moved to another level (the sum at level 3, the CAGR at level 2)."""
  for level, tasks in docqa_tasks.items():
    for t in tasks:
      opening = "What was {item} in" if re.match(r"What was [a-z ,]+ in \d{4}\? Answer", t.prompt) else None
      assert opening in DOCQA_LEVELS[level] or t.prompt.startswith(DOCQA_LEVELS[level]), (level, t.prompt)
    assert all(t.max_turns == 1 for t in tasks), level  # one answer, no tools


def test_two_year_questions_run_forward_in_time():
  """Catches a change, growth, margin change or average equity asked from the later year back to the
  earlier one (the textbook formula on the question's years then still gives the answer)."""
  checked = 0
  for ask in (docqa.q_growth, docqa.q_change, docqa.q_margin_change, docqa.q_avg_roe):
    for seed in range(40):
      rng = random.Random(seed)
      asked = ask(rng, docqa.build_report(rng, "train", years=5))
      if asked is None:
        continue
      y0, y1 = (int(y) for y in re.search(r"(\d{4}) (?:to|and) (\d{4})", asked[0]).groups())
      assert y0 < y1, (ask.__name__, asked[0])
      if ask in (docqa.q_growth, docqa.q_avg_roe):
        assert y1 == y0 + 1, (ask.__name__, asked[0])  # year on year
      checked += 1
  assert checked > 120


def test_current_assets_are_cash_receivables_and_inventory_in_the_rendered_table(docqa_tasks):
  """Catches a subtotal missing a line (the current ratio then read from a wrong subtotal)."""
  for t in docqa_tasks[1][:5]:
    rows = {line.split(" | ")[0][2:]: [int(v.replace(",", "")) for v in line.strip(" |").split(" | ")[1:]]
            for line in t["document"].splitlines() if line.startswith("| ") and "---" not in line}
    parts = zip(rows["Cash and equivalents"], rows["Accounts receivable"], rows["Inventory"], strict=True)
    assert [a + b + c for a, b, c in parts] == rows["Total current assets"], t.id


def test_report_years_vary_between_companies(docqa_tasks):
  """Catches every report starting in one year (2012)."""
  firsts = {int(re.search(r"\| Item \| (\d{4})", t["document"])[1]) for t in docqa_tasks[0]}
  assert len(firsts) >= 4 and firsts <= set(range(2012, 2021)), firsts


def test_interest_is_one_rate_on_long_term_debt_and_segments_are_whole_percents():
  """Catches interest charged on all liabilities (current liabilities bear none; the rate then moves
  with them from year to year) and segment figures cut from the first year's revenue (the last
  segment absorbing the growth)."""
  for seed in range(10):
    report = docqa.build_report(random.Random(seed), "train", years=5)
    s, years = report["statements"], report["years"]
    rates = [s["Interest expense"][y] / s["Long-term debt"][y] for y in years]
    assert max(rates) - min(rates) <= 1 / min(s["Long-term debt"][y] for y in years), (seed, rates)
    revenue = s["Revenue"][years[-1]]
    for value in list(report["segments"].values())[:-1]:  # the last one takes the rounding
      assert any(value == round(revenue * k / 100) for k in range(1, 100)), (seed, value, revenue)


def test_the_segment_question_asks_about_any_segment():
  """Catches the share question always about the alphabetically first segment."""
  later = 0
  for seed in range(40):
    rng = random.Random(seed)
    report = docqa.build_report(rng, "train", years=5)
    asked = docqa.q_segment(rng, report)  # None: a share below 1%
    if asked is not None:
      later += re.search(r"from the (\w+) segment", asked[0])[1] != sorted(report["segments"])[0]
  assert later >= 10


# ---- terminal ----------------------------------------------------------------------------------

TERMINAL_LEVELS = {0: {"create_file", "delete_file", "rename_file", "make_dir"},
                   1: {"rename_ext", "move_prefix", "count_matches", "sort_lines"},
                   2: {"csv_column", "sort_unique", "fix_config", "tar_dir"},
                   3: {"csv_report", "archive_logs", "config_edits"}}


@pytest.fixture(scope="module")
def terminal_tasks():
  return {level: terminal.generate(split="train", difficulty=level, n=30, seed=2)
          for level in TERMINAL_LEVELS}


def test_each_terminal_level_draws_its_own_templates_with_more_turns(terminal_tasks):
  """Catches a template moved to another level (sort_lines at level 0, tar_dir at level 3) and a turn
  budget that does not grow with the level (8 + 4 per level)."""
  for level, tasks in terminal_tasks.items():
    assert {t.meta["template"] for t in tasks} == TERMINAL_LEVELS[level], level
    assert {t.max_turns for t in tasks} == {8 + 4 * level}
    first = {t.oracle[0]["tool_calls"][0]["arguments"]["command"] == "ls -R" for t in tasks}
    assert first == {level >= 2}, level  # from level 2 the oracle looks before it acts


def test_an_instance_is_drawn_in_the_split_its_key_hashes_to():
  """Catches the split test inverted (train drawing the quarter meant for held-out): the splits stay
  disjoint, so the disjointness tests pass."""
  for split in ("train", "heldout"):
    for seed in range(30):
      name, spec = terminal._draw(random.Random(seed), split, seed % 4)
      assert common.split_of(("terminal", f"_{name}", spec["key"])) == split, (split, seed, name)
      company = docqa.company_name(random.Random(seed), split)
      assert common.split_of(("docqa-company", company)) == split, (split, seed, company)


def _state(files, commands, work):
  shutil.rmtree(work, ignore_errors=True)
  work.mkdir()
  for path, content in files.items():
    (work / path).parent.mkdir(parents=True, exist_ok=True)
    (work / path).write_text(content)
  for command in commands:
    subprocess.run(["bash", "-c", command], cwd=work, capture_output=True, timeout=30,
                   env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"})


def _passes(check, work, scratch):
  for path, content in check.get("files", {}).items():
    if not (work / path).is_file() or (work / path).read_text() != content:
      return False
  if any((work / path).exists() for path in check.get("absent", [])):
    return False
  command = check.get("command", "true").replace("/tmp/x", str(scratch))
  return subprocess.run(["bash", "-c", command], cwd=work, capture_output=True, timeout=30).returncode == 0


def test_the_untouched_directory_fails_every_check(terminal_tasks, tmp_path):
  """Catches a task that asks for no change (a config value 'changed' to the value it has), which
  an agent that does nothing solves."""
  if any(shutil.which(tool) is None for tool in ("bash", "tar")):
    pytest.skip("needs bash and tar")
  for tasks in terminal_tasks.values():
    for t in tasks:
      _state(t["files"], [], tmp_path / "w")
      assert not _passes(t["check"], tmp_path / "w", tmp_path / "x"), (t.id, t.prompt)


def test_an_archive_with_an_extra_top_level_member_fails_the_tar_check(tmp_path):
  """Catches the check that the archive holds the directory alone dropped: `tar -czf d.tar.gz d
  stray.txt` passed."""
  if any(shutil.which(tool) is None for tool in ("bash", "tar")):
    pytest.skip("needs bash and tar")
  task = next(t for t in terminal.generate(split="train", difficulty=2, n=40, seed=0)
              if t.meta["template"] == "tar_dir")
  d = next(iter(task["files"])).split("/")[0]
  files = {**task["files"], "stray.txt": "x\n"}
  _state(files, [f"tar -czf {d}.tar.gz {d} stray.txt"], tmp_path / "w")
  assert not _passes(task["check"], tmp_path / "w", tmp_path / "x")
  _state(files, [f"tar -czf {d}.tar.gz {d}"], tmp_path / "w")
  assert _passes(task["check"], tmp_path / "w", tmp_path / "x")


def test_rename_ext_has_two_txt_files_and_one_to_leave_alone():
  """Catches one .txt file only or none left to leave alone (the 'other files' the prompt names)."""
  for seed in range(80):
    spec = terminal._rename_ext(random.Random(seed))
    txt = [p for p in spec["files"] if p.endswith(".txt")]
    assert len(txt) >= 2 and len(spec["files"]) - len(txt) >= 1, spec["files"]


def test_a_count_task_counts_at_least_one_line():
  """Catches a log without the word (the answer 0 is what `grep -c` prints for a typo too)."""
  counts = [int(terminal._count_matches(random.Random(s))["check"]["files"]["count.txt"]) for s in range(200)]
  assert min(counts) >= 1


def test_a_count_near_miss_is_wrong_when_every_line_matches():
  """Catches the near miss `wc -l` kept when every line holds the word: it writes the right count and
  the corrupted oracle scores 1. (Seed 4432 draws such a log; about 1 in 1000 do.)"""
  spec = terminal._count_matches(random.Random(4432))
  lines = spec["files"]["log.txt"].splitlines()
  word = re.search(r"contain (\w+)", spec["prompt"])[1]
  assert all(word in line for line in lines) and spec["check"]["files"]["count.txt"] == f"{len(lines)}\n"
  assert spec["miss"] == f"echo {len(lines) + 1} > count.txt"
  for seed in range(30):
    spec = terminal._count_matches(random.Random(seed))
    if spec["miss"].startswith("wc -l"):
      assert spec["check"]["files"]["count.txt"] != f"{spec['files']['log.txt'].count(chr(10))}\n"


def test_every_config_value_asked_for_is_a_new_value():
  """Catches an edit that sets a key to the value it already has (a step an agent may skip and pass)."""
  checked = 0
  for make in (terminal._fix_config, terminal._config_edits):
    for seed in range(40):
      spec = make(random.Random(seed))
      before = dict(line.split("=", 1) for line in spec["files"]["app.conf"].splitlines()[1:])
      for key, value in re.findall(r"(?:value of|set) '(\w+)' to '([^']*)'", spec["prompt"]):
        assert before[key] != value, (make.__name__, seed, key, value)
        checked += 1
  assert checked == 40 + 80
