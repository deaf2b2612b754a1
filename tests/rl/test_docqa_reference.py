"""DocQA answers recomputed from the rendered report alone (each test names the mistake it catches).

The oracle replay tests grade the oracle against the task's own answer, so a wrong formula in a
question (growth over the new year, a CAGR over one year too many, the last year's equity for the
average) passes them: both come from the same code. Here every answer is worked out again from the
markdown the model reads, by the textbook formula written out below.
"""

import re

import pytest

from rl.tasks.answers import answers_match, extract_answer
from rl.tasks.generators import docqa


def _tables(document):
  """{item (lower case): {year: value}} from every markdown table of the report."""
  rows, years = {}, None
  for line in document.splitlines():
    if line.startswith("| Item |"):
      years = [int(y) for y in line.strip("| ").split(" | ")[1:]]
    elif line.startswith("| ") and years:
      cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
      rows[cells[0].lower()] = {y: int(v.replace(",", "")) for y, v in zip(years, cells[1:], strict=True)}
  return rows, years


def _note(document, pattern):
  return int(re.search(pattern, document)[1].replace(",", ""))


def _reference(question, document):
  """The answer by the plain formula, from the question's words and the report's tables."""
  t, _ = _tables(document)

  def v(item, year):
    return t[item.lower()][int(year)]

  def margin(item, year):
    return v(item, year) / v("revenue", year) * 100

  def equity(year):
    return v("shareholders' equity", year)

  forms = [
    (r"What was (.+) in (\d{4})\? Answer", lambda m: v(m[1], m[2])),
    (r"By what percentage did (.+) change from (\d{4}) to (\d{4})\?",
     lambda m: (v(m[1], m[3]) - v(m[1], m[2])) / v(m[1], m[2]) * 100),
    (r"What was the \w+ margin \((.+) as a percentage of revenue\) in (\d{4})\?",
     lambda m: margin(m[1], m[2])),
    (r"By how much did (.+) change from (\d{4}) to (\d{4}) \(negative",
     lambda m: v(m[1], m[3]) - v(m[1], m[2])),
    (r"What was the current ratio at the end of (\d{4})",
     lambda m: v("total current assets", m[1]) / v("current liabilities", m[1])),
    (r"What was the ratio of total liabilities to shareholders' equity at the end of (\d{4})",
     lambda m: v("total liabilities", m[1]) / equity(m[1])),
    (r"What was the return on equity in (\d{4})", lambda m: v("net income", m[1]) / equity(m[1]) * 100),
    (r"What was the effective tax rate in (\d{4})",
     lambda m: v("income tax", m[1]) / v("income before taxes", m[1]) * 100),
    (r"What were the earnings per share in (\d{4})",
     lambda m: v("net income", m[1]) / _note(document, rf"Shares outstanding at the end of {m[1]}: ([\d,]+)")
     ),
    (r"What was the total (.+) over the years (\d{4}) to (\d{4}), summed",
     lambda m: sum(v(m[1], y) for y in range(int(m[2]), int(m[3]) + 1))),
    (r"What was the compound annual growth rate of revenue from (\d{4}) to (\d{4})",
     lambda m: ((v("revenue", m[2]) / v("revenue", m[1])) ** (1 / (int(m[2]) - int(m[1]))) - 1) * 100),
    (r"What was the average net margin .* over (\d{4}) to (\d{4})",
     lambda m: sum(margin("net income", y) for y in range(int(m[1]), int(m[2]) + 1))
     / (int(m[2]) - int(m[1]) + 1)),
    (r"By how many percentage points did the operating margin change from (\d{4}) to (\d{4})",
     lambda m: margin("operating income", m[2]) - margin("operating income", m[1])),
    (r"What share of (\d{4}) revenue came from the (\w+) segment",
     lambda m: _note(document, rf"{m[2]} ([\d,]+)") / v("revenue", m[1]) * 100),
    (r"What was the return on average equity in (\d{4}) .* of the (\d{4}) and",
     lambda m: v("net income", m[1]) / ((equity(m[1]) + equity(m[2])) / 2) * 100),
    (r"What was the interest coverage ratio in (\d{4})",
     lambda m: v("operating income", m[1]) / v("interest expense", m[1])),
  ]
  for pattern, formula in forms:
    if m := re.match(pattern, question):
      return formula(m)
  raise AssertionError(f"no reference formula for {question!r}")


@pytest.mark.parametrize("level", range(docqa.MAX_DIFFICULTY + 1))
def test_every_answer_is_the_plain_formula_on_the_rendered_report(level):
  """Catches a wrong formula (growth over the later year, a CAGR over n + 1 years, the year-end
  equity for the average, the margin change reversed, a sum missing a year, a ratio upside down),
  a figure a question needs left out of the report at its level, and an oracle that does not say
  the answer."""
  for split in ("train", "heldout"):
    for task in docqa.generate(split=split, difficulty=level, n=25, seed=4):
      want = _reference(task.prompt, task["document"])
      answer, tolerance = task["answer"], task["tolerance"]
      if isinstance(answer, int):  # whole thousands of dollars: exact
        assert answer == want and tolerance == 0, (task.id, task.prompt)
        assert not answers_match(str(answer + 1), answer, tolerance), task.id
      else:  # two decimals, |answer| >= 1, graded to +-0.015
        assert answer == round(want, 2) and abs(answer) >= 1, (task.id, task.prompt, want)
        for delta, ok in [(0.01, True), (-0.01, True), (0.02, False), (-0.02, False)]:
          assert answers_match(f"{answer + delta:.2f}", answer, tolerance) is ok, (task.id, answer, delta)
      assert answers_match(extract_answer(task.oracle[-1]["content"]), str(round(want, 2)), 1e-12), task.id
      shown = f"{answer:,}" if isinstance(answer, int) else f"{answer:.2f}"
      assert shown in task.oracle[-1]["thinking"], (task.id, shown)  # the working ends in the answer


@pytest.mark.parametrize("level", range(docqa.MAX_DIFFICULTY + 1))
def test_every_question_kind_of_the_level_against_the_plain_formula(level):
  """Each question function of the level on 60 reports: a kind the generator seldom draws (the
  liabilities-to-equity ratio, 4% of level 2) is checked as often as the others."""
  import random
  for ask in docqa.QUESTIONS[level]:
    checked = 0
    for seed in range(60):
      rng = random.Random(seed)
      report = docqa.build_report(rng, "train", years=2 + level)
      asked = ask(rng, report)
      if asked is None:
        continue
      question, answer, _ = asked
      want = _reference(question, docqa.render(report, level))
      assert answer == (want if isinstance(answer, int) else round(want, 2)), (ask.__name__, seed, question)
      # |answer| >= 1: the slack of 0.015 stays within 1.5% of the answer
      assert isinstance(answer, int) or abs(answer) >= 1, (ask.__name__, seed, answer)
      checked += 1
    assert checked >= 10, ask.__name__


@pytest.mark.parametrize("level", range(docqa.MAX_DIFFICULTY + 1))
def test_the_report_grows_with_the_level(level):
  """2, 3, 4, 5 years; the balance sheet from level 1, the notes from level 2 (a level-2 question
  about shares or segments had no figure to read without them); the figures add up."""
  task = docqa.generate(split="train", difficulty=level, n=1, seed=0)[0]
  doc = task["document"]
  t, years = _tables(doc)
  assert len(years) == 2 + level and years == list(range(years[0], years[0] + 2 + level))
  assert ("## Consolidated balance sheet" in doc) == (level >= 1)
  assert ("## Notes" in doc) == (level >= 2)
  assert ("## Management discussion" in doc) == (level >= 3)
  for y in years:
    assert t["gross profit"][y] == t["revenue"][y] - t["cost of revenue"][y]
    assert t["net income"][y] == t["income before taxes"][y] - t["income tax"][y]
  if level >= 2:
    segments = re.search(r"Revenue by segment in \d{4}: (.*)\.\n", doc)[1].split("; ")
    assert sum(int(s.rsplit(" ", 1)[1].replace(",", "")) for s in segments) == t["revenue"][years[-1]]


@pytest.mark.parametrize(("answer", "tolerance", "wrong"), [
  (0, 0.0, 1), (7, 0.0, 9), (-10, 0.0, -7), (1234, 0.0, 1604), (12.34, 0.015 / 12.34, 16.04),
  (-2.5, 0.015 / 2.5, -1.5), (1.0, 0.015, 2.0),
])
def test_wrong_number_is_off_by_thirty_percent_and_at_least_one(answer, tolerance, wrong):
  """The corrupted oracle's number: answer + max(30% of |answer|, 1) (rounded as the answer is); a
  change of 0 corrupted to 0 would let a grader that accepts anything pass its own test."""
  got = docqa.wrong_number(answer, tolerance)
  assert got == pytest.approx(wrong, abs=1e-9) and type(got) is type(answer)
  assert not answers_match(str(got), answer, tolerance)


def test_the_same_draws_give_each_split_its_own_companies():
  """Catches company names not assigned to a split: from one RNG state both splits drew the same
  name (a random draw of 30 names per split seldom collides, so a plain overlap test missed it)."""
  import random
  train = [docqa.company_name(random.Random(seed), "train") for seed in range(40)]
  heldout = [docqa.company_name(random.Random(seed), "heldout") for seed in range(40)]
  assert not set(train) & set(heldout)
  assert len(set(train)) > 30 and len(set(heldout)) > 30
