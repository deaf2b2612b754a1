"""DocQA tasks: questions about a generated annual report (markdown tables and notes).

Levels (the report grows with the level: 2, 3, 4, 5 years; statements and notes are added):
  0  look up one figure (income statement, two years).
  1  one operation: growth %, gross or operating margin, change between two years.
  2  across statements and notes: current ratio, liabilities to equity, return on equity,
     effective tax rate, earnings per share, a multi-year sum.
  3  several steps: compound annual growth, average margin, margin change in percentage
     points, a segment's share of revenue, return on average equity, interest coverage.

Figures are whole thousands of dollars and add up (gross profit = revenue - cost of revenue,
total assets = current assets + PP&E, ...). Integer answers are graded exactly (tolerance 0);
percentages and ratios are asked to two decimals and graded to within `ANSWER_SLACK` (0.015) of
the rounded value, whatever its size (`ratio_tolerance`, a relative tolerance as the schema
stores it; such answers are drawn with |value| >= 1): a last-digit rounding difference passes,
0.02 off does not. A flat 1% relative let through answers rounded to whole numbers and the
methods a question rules out (the pooled margin of an average-of-margins question).
Company names belong to one split (`common.split_of`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from rl.tasks.generators import common
from rl.tasks.schema import Task, parse_task

DOMAIN = "docqa"
MAX_DIFFICULTY = 3
ANSWER_SLACK = 0.015  # absolute half-width of the band a two-decimal answer is graded in
_SUFFIXES = ("Holdings", "Group", "Industries", "Corporation", "Systems", "Partners")
_INDUSTRIES = ("industrial machinery", "consumer electronics", "packaged foods", "specialty chemicals",
               "logistics", "medical devices", "software", "building materials")
_SEGMENTS = ("Products", "Services", "Licensing", "International", "Components")
_INCOME = ("Revenue", "Cost of revenue", "Gross profit", "Research and development",
           "Selling, general and administrative", "Operating income", "Interest expense",
           "Income before taxes", "Income tax", "Net income")
_BALANCE = ("Cash and equivalents", "Accounts receivable", "Inventory", "Total current assets",
            "Property, plant and equipment", "Total assets", "Current liabilities", "Long-term debt",
            "Total liabilities", "Shareholders' equity")
_PCT = "Give the percentage rounded to two decimal places, without the % sign (e.g. 12.34)."
_RATIO = "Give the ratio rounded to two decimal places (e.g. 1.23)."
_USD = "Answer in thousands of US dollars, as the report states figures."
_FINISH = "Finish with the answer alone inside <answer></answer>."
_ONSETS = ("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "cr", "st",
           "tr", "pl", "gr")
_VOWELS = ("a", "e", "i", "o", "u", "ia")


# ---- the report ----------------------------------------------------------------------------


def company_name(rng: random.Random, split: str) -> str:
  """A fictional company name of `split` (names of the other split are never drawn)."""
  while True:
    stem = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.choice((2, 3))))
    name = f"{stem.capitalize()}{rng.choice(('', 'on', 'ar', 'is'))} {rng.choice(_SUFFIXES)}"
    if common.split_of(("docqa-company", name)) == split:
      return name


def _year(rng: random.Random, revenue: int, r: dict[str, float]) -> dict[str, int]:
  """One year's statements from revenue and the company's ratios (`r`), all figures consistent."""
  f: dict[str, int] = {"Revenue": revenue}
  f["Cost of revenue"] = round(revenue * (r["cogs"] + rng.uniform(-0.03, 0.03)))
  f["Gross profit"] = revenue - f["Cost of revenue"]
  f["Research and development"] = round(revenue * (r["rnd"] + rng.uniform(-0.01, 0.01)))
  f["Selling, general and administrative"] = round(revenue * (r["sga"] + rng.uniform(-0.01, 0.01)))
  f["Operating income"] = f["Gross profit"] - f["Research and development"] - f[
    "Selling, general and administrative"]
  assets = round(revenue * (r["assets"] + rng.uniform(-0.05, 0.05)))
  f["Cash and equivalents"] = round(assets * rng.uniform(0.05, 0.2))
  f["Accounts receivable"] = round(assets * rng.uniform(0.08, 0.2))
  f["Inventory"] = round(assets * rng.uniform(0.05, 0.2))
  f["Total current assets"] = f["Cash and equivalents"] + f["Accounts receivable"] + f["Inventory"]
  f["Property, plant and equipment"] = assets - f["Total current assets"]
  f["Total assets"] = assets
  f["Current liabilities"] = round(f["Total current assets"] * rng.uniform(0.4, 0.9))
  f["Long-term debt"] = round(assets * (r["debt"] + rng.uniform(-0.03, 0.03)))
  f["Total liabilities"] = f["Current liabilities"] + f["Long-term debt"]
  f["Shareholders' equity"] = assets - f["Total liabilities"]
  f["Interest expense"] = round(f["Long-term debt"] * r["rate"])
  f["Income before taxes"] = f["Operating income"] - f["Interest expense"]
  # The rate moves from year to year, so a tax-rate question is about its year (with one rate for
  # every year, any year's rate graded right).
  f["Income tax"] = round(max(f["Income before taxes"], 0) * (r["tax"] + rng.uniform(-0.03, 0.03)))
  f["Net income"] = f["Income before taxes"] - f["Income tax"]
  return f


def build_report(rng: random.Random, split: str, years: int) -> dict[str, Any]:
  """A company and `years` years of statements ({item: {year: value}}) plus its notes."""
  ratios = {"cogs": rng.uniform(0.45, 0.68), "rnd": rng.uniform(0.02, 0.08), "sga": rng.uniform(0.08, 0.15),
            "assets": rng.uniform(0.7, 1.4), "debt": rng.uniform(0.1, 0.3), "rate": rng.uniform(0.03, 0.08),
            "tax": rng.uniform(0.18, 0.3)}
  first = rng.randrange(2012, 2021)
  revenue = rng.randrange(20_000, 900_000)
  statements: dict[str, dict[int, int]] = {}
  for year in range(first, first + years):
    for item, value in _year(rng, revenue, ratios).items():
      statements.setdefault(item, {})[year] = value
    revenue = round(revenue * (1 + rng.uniform(-0.06, 0.22)))
  last = first + years - 1
  names = rng.sample(_SEGMENTS, rng.choice((2, 3)))
  cuts = sorted(rng.sample(range(1, 100), len(names) - 1))
  shares = [b - a for a, b in zip([0, *cuts], [*cuts, 100], strict=True)]
  segments = {n: round(statements["Revenue"][last] * s / 100) for n, s in zip(names, shares, strict=True)}
  segments[names[-1]] += statements["Revenue"][last] - sum(segments.values())  # add up exactly
  return {"company": company_name(rng, split), "industry": rng.choice(_INDUSTRIES),
          "years": list(range(first, first + years)), "statements": statements, "segments": segments,
          "shares": rng.randrange(5_000, 200_000), "employees": rng.randrange(150, 60_000)}


def _table(report: dict[str, Any], items: tuple[str, ...]) -> list[str]:
  years = report["years"]
  rows = ["| Item | " + " | ".join(map(str, years)) + " |", "|---|" + "---:|" * len(years)]
  for item in items:
    rows.append(f"| {item} | " + " | ".join(f"{report['statements'][item][y]:,}" for y in years) + " |")
  return rows


def render(report: dict[str, Any], level: int) -> str:
  """The report as markdown; higher levels add the balance sheet, notes and narrative."""
  c, years = report["company"], report["years"]
  lines = [f"# {c}: annual report {years[-1]}", "",
           f"{c} is a {report['industry']} company. All amounts are in thousands of US dollars unless "
           "stated otherwise.", "", "## Consolidated income statement", "", *_table(report, _INCOME)]
  if level >= 1:
    lines += ["", "## Consolidated balance sheet (at year end)", "", *_table(report, _BALANCE)]
  if level >= 2:
    lines += ["", "## Notes", "",
              f"1. Shares outstanding at the end of {years[-1]}: {report['shares']:,} thousand.",
              f"2. Employees at the end of {years[-1]}: {report['employees']:,}.",
              f"3. Revenue by segment in {years[-1]}: " + "; ".join(
                f"{name} {value:,}" for name, value in report["segments"].items()) + "."]
  if level >= 3:
    lines += ["", "## Management discussion", "",
              f"Management believes {c} is well placed in {report['industry']}. Figures for earlier years "
              "are restated for comparability; segment figures are unaudited. Capital spending "
              "focused on capacity and automation, and the company kept a conservative balance sheet."]
  return "\n".join(lines) + "\n"


# ---- questions: each returns (question, answer, reasoning) or None to draw another ---------
Question = tuple[str, int | float, str] | None


def _v(report: dict[str, Any], item: str, year: int) -> int:
  return report["statements"][item][year]


def _pct(question: str, value: float, reasoning: str) -> Question:
  return None if abs(value) < 1 else (f"{question} {_PCT}", round(value, 2), f"{reasoning} = {value:.2f}%.")


def _ratio(question: str, value: float, reasoning: str) -> Question:
  return None if abs(value) < 1 else (f"{question} {_RATIO}", round(value, 2), f"{reasoning} = {value:.2f}.")


def q_lookup(rng: random.Random, r: dict[str, Any]) -> Question:
  item, year = rng.choice(_INCOME), rng.choice(r["years"])
  value = _v(r, item, year)
  return f"What was {item.lower()} in {year}? {_USD}", value, f"The row {item}, column {year}: {value:,}."


def q_growth(rng: random.Random, r: dict[str, Any]) -> Question:
  item = rng.choice(("Revenue", "Net income", "Operating income", "Total assets"))
  i = rng.randrange(1, len(r["years"]))
  y0, y1 = r["years"][i - 1], r["years"][i]
  a, b = _v(r, item, y0), _v(r, item, y1)
  if a <= 0:
    return None
  return _pct(f"By what percentage did {item.lower()} change from {y0} to {y1}?", (b - a) / a * 100,
              f"{item}: {y0} {a:,}, {y1} {b:,}. Change = ({b:,} - {a:,}) / {a:,} * 100")


def q_margin(rng: random.Random, r: dict[str, Any]) -> Question:
  item = rng.choice(("Gross profit", "Operating income", "Net income"))
  year = rng.choice(r["years"])
  a, rev = _v(r, item, year), _v(r, "Revenue", year)
  name = {"Gross profit": "gross margin", "Operating income": "operating margin", "Net income": "net margin"}
  return _pct(f"What was the {name[item]} ({item.lower()} as a percentage of revenue) in {year}?",
              a / rev * 100, f"{item} {a:,} / revenue {rev:,} * 100")


def q_change(rng: random.Random, r: dict[str, Any]) -> Question:
  item = rng.choice(_INCOME + _BALANCE)
  y0, y1 = sorted(rng.sample(r["years"], 2))
  a, b = _v(r, item, y0), _v(r, item, y1)
  return (f"By how much did {item.lower()} change from {y0} to {y1} (negative for a decrease)? {_USD}", b - a,
          f"{item}: {y1} {b:,} minus {y0} {a:,} = {b - a:,}.")


def q_balance_ratio(rng: random.Random, r: dict[str, Any]) -> Question:
  year = rng.choice(r["years"])
  num, den, name = rng.choice((("Total current assets", "Current liabilities", "current ratio"),
                               ("Total liabilities", "Shareholders' equity", "ratio of total liabilities to "
                                                                             "shareholders' equity")))
  a, b = _v(r, num, year), _v(r, den, year)
  return _ratio(f"What was the {name} at the end of {year}?", a / b, f"{num} {a:,} / {den.lower()} {b:,}")


def q_roe(rng: random.Random, r: dict[str, Any]) -> Question:
  year = rng.choice(r["years"])
  a, b = _v(r, "Net income", year), _v(r, "Shareholders' equity", year)
  return _pct(f"What was the return on equity in {year} (net income as a percentage of year-end "
              "shareholders' equity)?", a / b * 100, f"Net income {a:,} / equity {b:,} * 100")


def q_tax_rate(rng: random.Random, r: dict[str, Any]) -> Question:
  year = rng.choice(r["years"])
  a, b = _v(r, "Income tax", year), _v(r, "Income before taxes", year)
  if b <= 0:
    return None
  return _pct(f"What was the effective tax rate in {year} (income tax as a percentage of income before "
              "taxes)?", a / b * 100, f"Income tax {a:,} / income before taxes {b:,} * 100")


def q_eps(rng: random.Random, r: dict[str, Any]) -> Question:
  year = r["years"][-1]
  ni, shares = _v(r, "Net income", year), r["shares"]
  value = ni / shares  # both in thousands: dollars per share
  if abs(value) < 1:
    return None
  return (f"What were the earnings per share in {year} (net income divided by shares outstanding at year "
          "end), in dollars? Round to two decimal places.", round(value, 2),
          f"Net income {ni:,} thousand / {shares:,} thousand shares = {value:.2f} dollars.")


def q_sum(rng: random.Random, r: dict[str, Any]) -> Question:
  item = rng.choice(_INCOME)
  values = [_v(r, item, y) for y in r["years"]]
  years = f"{r['years'][0]} to {r['years'][-1]}"
  return (f"What was the total {item.lower()} over the years {years}, summed? {_USD}", sum(values),
          f"{item} by year: {' + '.join(f'{v:,}' for v in values)} = {sum(values):,}.")


def q_cagr(rng: random.Random, r: dict[str, Any]) -> Question:
  y0, y1 = r["years"][0], r["years"][-1]
  a, b = _v(r, "Revenue", y0), _v(r, "Revenue", y1)
  n = y1 - y0
  value = ((b / a) ** (1 / n) - 1) * 100
  return _pct(f"What was the compound annual growth rate of revenue from {y0} to {y1}?", value,
              f"Revenue {y0} {a:,}, {y1} {b:,}, {n} years. CAGR = (({b:,} / {a:,}) ** (1/{n}) - 1) * 100")


def q_avg_margin(rng: random.Random, r: dict[str, Any]) -> Question:
  margins = [_v(r, "Net income", y) / _v(r, "Revenue", y) * 100 for y in r["years"]]
  steps = ", ".join(f"{y}: {m:.4f}%" for y, m in zip(r["years"], margins, strict=True))
  return _pct(f"What was the average net margin (net income as a percentage of revenue) over {r['years'][0]}"
              f" to {r['years'][-1]}, averaging the yearly margins?", sum(margins) / len(margins),
              f"Yearly net margins {steps}. Average = {sum(margins):.4f} / {len(margins)}")


def q_margin_change(rng: random.Random, r: dict[str, Any]) -> Question:
  y0, y1 = sorted(rng.sample(r["years"], 2))
  m0 = _v(r, "Operating income", y0) / _v(r, "Revenue", y0) * 100
  m1 = _v(r, "Operating income", y1) / _v(r, "Revenue", y1) * 100
  value = m1 - m0
  if abs(value) < 1:
    return None
  return (f"By how many percentage points did the operating margin change from {y0} to {y1} (negative for "
          f"a decrease)? Round to two decimal places.", round(value, 2),
          f"Operating margin {y0} = {m0:.4f}%, {y1} = {m1:.4f}%. Change = {value:.2f} points.")


def q_segment(rng: random.Random, r: dict[str, Any]) -> Question:
  name = rng.choice(sorted(r["segments"]))
  year = r["years"][-1]
  a, rev = r["segments"][name], _v(r, "Revenue", year)
  return _pct(f"What share of {year} revenue came from the {name} segment?", a / rev * 100,
              f"{name} segment {a:,} / revenue {rev:,} * 100")


def q_avg_roe(rng: random.Random, r: dict[str, Any]) -> Question:
  i = rng.randrange(1, len(r["years"]))
  y0, y1 = r["years"][i - 1], r["years"][i]
  e0, e1, ni = _v(r, "Shareholders' equity", y0), _v(r, "Shareholders' equity", y1), _v(r, "Net income", y1)
  return _pct(f"What was the return on average equity in {y1} (net income divided by the average of the "
              f"{y0} and {y1} year-end shareholders' equity)?", ni / ((e0 + e1) / 2) * 100,
              f"Average equity = ({e0:,} + {e1:,}) / 2 = {(e0 + e1) / 2:,.1f}. Net income {ni:,} / "
              f"{(e0 + e1) / 2:,.1f} * 100")


def q_coverage(rng: random.Random, r: dict[str, Any]) -> Question:
  year = rng.choice(r["years"])
  a, b = _v(r, "Operating income", year), _v(r, "Interest expense", year)
  if b <= 0:
    return None
  return _ratio(f"What was the interest coverage ratio in {year} (operating income divided by interest "
                "expense)?", a / b, f"Operating income {a:,} / interest expense {b:,}")


QUESTIONS: dict[int, tuple[Callable[[random.Random, dict[str, Any]], Question], ...]] = {
  0: (q_lookup,),
  1: (q_growth, q_margin, q_change),
  2: (q_balance_ratio, q_roe, q_tax_rate, q_eps, q_sum),
  3: (q_cagr, q_avg_margin, q_margin_change, q_segment, q_avg_roe, q_coverage),
}


# ---- the generator interface ---------------------------------------------------------------


def ratio_tolerance(answer: float) -> float:
  """The relative tolerance that admits answers within ANSWER_SLACK of `answer` (|answer| >= 1)."""
  return ANSWER_SLACK / abs(answer)


def _one(split: str, difficulty: int, seed: int, index: int) -> Task:
  rng = common.task_rng(DOMAIN, split, difficulty, seed, index)
  for _ in range(100):
    report = build_report(rng, split, years=2 + difficulty)
    drawn = rng.choice(QUESTIONS[difficulty])(rng, report)
    if drawn is not None:
      break
  else:
    raise RuntimeError(f"docqa generator drew no valid question for {split} d{difficulty} s{seed} i{index}")
  question, answer, reasoning = drawn
  tolerance = 0.0 if isinstance(answer, int) else ratio_tolerance(answer)
  obj = {"id": common.task_id(DOMAIN, split, difficulty, seed, index), "domain": DOMAIN,
         "document": render(report, difficulty), "prompt": f"{question} {_FINISH}", "answer": answer,
         "tolerance": tolerance, "max_turns": 1,
         "oracle": [common.turn(reasoning, content=f"<answer>{answer}</answer>")],
         "meta": common.meta(DOMAIN, split, difficulty, seed, company=report["company"])}
  return parse_task(obj, obj["id"])


def generate(*, split: str, difficulty: int, n: int, seed: int) -> list[Task]:
  """`n` docqa tasks of `split` at `difficulty` (see the module docstring for the levels)."""
  common.check_args(DOMAIN, split, difficulty, MAX_DIFFICULTY, seed, n)
  return [_one(split, difficulty, seed, i) for i in range(n)]


def wrong_number(answer: int | float, tolerance: float) -> int | float:
  """A number well outside `tolerance` of `answer`: off by 30% of it, and at least by 1."""
  delta = max(abs(answer) * 0.3, 1.0, 2 * tolerance * abs(answer))
  return answer + (round(delta) if isinstance(answer, int) else round(delta, 2))


def corrupt_oracle(task: Task) -> list[dict[str, Any]]:
  """The oracle's reasoning with a wrong final number."""
  wrong = wrong_number(task["answer"], task["tolerance"])
  return [{**task.oracle[-1], "content": f"<answer>{wrong}</answer>"}]
