"""Math tasks from reasoning-gym's procedural datasets, with worked solutions as oracles.

reasoning-gym (https://github.com/open-thought/reasoning-gym) generates each question from
`random.Random(seed + index)`. We build every task from its own dataset of size 1 whose seed
comes from `common.task_rng`, with the split in the seed's lowest bit, so the two splits
never share a seed; and a question belongs to the split `common.split_of` gives its text
(a draw from the other split's half is redrawn), so no question text is in both splits even
where the generation space is small (level 0 has about 16,000 questions). Texts that pose one
problem (12 + 7 and 7 + 12, 4 * 5 and 5 * 4, gcd(6, 26) and gcd(26, 6), an equation in another
letter) share a key (`split_key`), so a problem is in one split however it is written.

Levels (datasets and their reasoning-gym configs in `LEVELS`; the mix in `DEFAULT_WEIGHTS`):

  0  one + or - of two numbers of 1-2 digits (chain_sum)
  1  short chains, one-digit products, small gcd/lcm, legs of a few animals, letter counts
  2  mixed + - * / expressions, two-digit products, larger gcd/lcm and counting
  3  longer expressions with parentheses, three-term products, gcd/lcm of three numbers,
     linear equations
  4  GSM-style word problems (gsm_symbolic), long expressions, harder equations

The oracle thinks through a solution we compute ourselves (the arithmetic steps, + and - of
whole numbers digit by digit with carries and borrows, Euclid's
algorithm, the per-item counts, the equation rearranged; gsm_symbolic's own chain of
thought) and answers `<answer>X</answer>`; a task is only written when our value agrees
with reasoning-gym's answer under the grader's exact comparison. Its thinking follows the
tier (`thinking_by_tier`): the result alone at `low`, the working at `high`, and at `max` the
slowest route: + and - columns counted unit by unit before each is written (the successor
alone, not the digit table), other working followed by a second pass as a check.
"""

from __future__ import annotations

import ast
import functools
import math
import operator
import random
import re
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from rl.tasks.answers import answers_match, parse_number
from rl.tasks.generators import common
from rl.tasks.schema import Task, parse_task

DOMAIN = "math"
MAX_DIFFICULTY = 4
MAX_TURNS = 1
_MAX_DRAWS = 200
# The grader compares integer answers exactly and other numbers at a relative 1e-9
# (answers.MATH_REL_TOL), so above 1e9 an off-by-one non-integer answer would pass; questions
# with larger answers are redrawn.
MAX_ABS_ANSWER = 10**8
_FLOAT_NOISE = re.compile(r"\d\.\d*(?:0{6}|9{6})\d")
ANSWER_FORMAT = "Give your final answer inside <answer></answer>."

# reasoning-gym configs per level: {dataset name: config keyword arguments}.
LEVELS: tuple[Mapping[str, Mapping[str, Any]], ...] = (
  {"chain_sum": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2)},
  {"chain_sum": dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2),
   "products": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
   "gcd": dict(min_numbers=2, max_numbers=2, min_value=2, max_value=50),
   "lcm": dict(min_numbers=2, max_numbers=2, min_value=2, max_value=12),
   "leg_counting": dict(min_animals=1, max_animals=2, min_instances=1, max_instances=4),
   "letter_counting": dict(min_words=2, max_words=5)},
  {"chain_sum": dict(min_terms=3, max_terms=5, min_digits=1, max_digits=3),
   "basic_arithmetic": dict(min_terms=3, max_terms=3, min_digits=1, max_digits=2, allow_parentheses=False,
                            allow_negation=False),
   "products": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2),
   "gcd": dict(min_numbers=2, max_numbers=2, min_value=10, max_value=300),
   "lcm": dict(min_numbers=2, max_numbers=2, min_value=2, max_value=40),
   "leg_counting": dict(min_animals=2, max_animals=4, min_instances=1, max_instances=8),
   "letter_counting": dict(min_words=5, max_words=10)},
  {"basic_arithmetic": dict(min_terms=3, max_terms=5, min_digits=1, max_digits=3),
   "products": dict(min_terms=2, max_terms=3, min_digits=1, max_digits=3),
   "gcd": dict(min_numbers=2, max_numbers=3, min_value=10, max_value=1000),
   "lcm": dict(min_numbers=2, max_numbers=3, min_value=2, max_value=60),
   "leg_counting": dict(min_animals=3, max_animals=6, min_instances=1, max_instances=12),
   "simple_equations": dict(min_terms=2, max_terms=3, min_value=1, max_value=20)},
  {"gsm_symbolic": {},
   "basic_arithmetic": dict(min_terms=4, max_terms=6, min_digits=2, max_digits=3),
   "products": dict(min_terms=2, max_terms=3, min_digits=2, max_digits=3),
   "gcd": dict(min_numbers=3, max_numbers=4, min_value=100, max_value=10000),
   "lcm": dict(min_numbers=3, max_numbers=4, min_value=2, max_value=100),
   "leg_counting": dict(min_animals=5, max_animals=10, min_instances=1, max_instances=15),
   "simple_equations": dict(min_terms=2, max_terms=4, min_value=1, max_value=100)},
)
assert len(LEVELS) == MAX_DIFFICULTY + 1

# The mix: relative weight of each dataset wherever a level offers it (a config may pass its
# own dict to `generate`; a dataset missing from it is not drawn).
DEFAULT_WEIGHTS: Mapping[str, float] = {
  "chain_sum": 1.0, "basic_arithmetic": 1.0, "products": 1.0, "gcd": 0.5, "lcm": 0.5,
  "leg_counting": 0.5, "letter_counting": 0.5, "simple_equations": 1.0, "gsm_symbolic": 3.0,
}


# ---- worked solutions: (thinking text, value) or None for an ill-posed item ----------------


_OPS = {ast.Add: ("+", operator.add), ast.Sub: ("-", operator.sub), ast.Mult: ("*", operator.mul),
        ast.Div: ("/", operator.truediv)}


def _fmt(x: Fraction) -> str:
  return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def _count(start: int, n: int, step: int) -> list[str]:
  """`n` unit steps from `start` (step +1 or -1), each numbered: the column's fact worked out
  from the successor alone, for the max tier ([] for no steps)."""
  if n == 0:
    return []
  word = "up" if step > 0 else "down"
  marks = ", ".join(f"{start + step * k} ({k})" for k in range(1, n + 1))
  return [f"count {word} from {start} by {n}: {marks}"]


def _column_add(a: int, b: int, count: bool = False) -> list[str]:
  """a + b (both >= 0) column by column from the right; each line ends with the digits so far.
  count: each column's sum is first counted up unit by unit (`_count`)."""
  xs, ys = str(a)[::-1], str(b)[::-1]
  width, carry, so_far, lines = max(len(xs), len(ys)), 0, "", []
  for i in range(width):
    x, y = int(xs[i]) if i < len(xs) else 0, int(ys[i]) if i < len(ys) else 0
    total = x + y + carry
    last = i == width - 1
    so_far = (str(total) if last else str(total % 10)) + so_far
    if count:
      lines += _count(x, y + carry, 1)
    lines.append(f"{x} + {y}{' + 1' if carry else ''} = {total} -> {so_far}"
                 + (" carry 1" if total >= 10 and not last else ""))
    carry = total // 10
  return lines


def _column_sub(a: int, b: int, count: bool = False) -> list[str]:
  """a - b (a >= b >= 0) column by column from the right, borrowing where a digit is short.
  count: each column's difference is first counted down unit by unit (`_count`)."""
  xs, ys = str(a)[::-1], str(b)[::-1]
  borrow, so_far, lines = 0, "", []
  for i in range(len(xs)):
    x, y = int(xs[i]), int(ys[i]) if i < len(ys) else 0
    top = x - borrow
    head = f"{x}{' - 1' if borrow else ''} - {y}"
    if count:  # x - borrow - y (+ 10): down from x (+ 10) by y + borrow
      lines += _count(x + 10 * (top < y), y + borrow, -1)
    if top < y:
      digit, borrow, tail = top + 10 - y, 1, " borrow 1"
      head += " + 10"
    else:
      digit, borrow, tail = top - y, 0, ""
    so_far = str(digit) + so_far
    lines.append(f"{head} = {digit} -> {so_far}{tail}")
  return lines


def _column_steps(left: Fraction, symbol: str, right: Fraction, value: Fraction,
                  count: bool = False) -> list[str]:
  """Digit-by-digit working for + and - of whole numbers >= 0 (a small model learns the digit
  table and the carry, not every pair of numbers); [] where it does not apply.

  One-digit operands get the same column line: the table is learnt from the columns of every
  longer sum, so a held-out `3 + 8` or `1 - 9` (a question never trained on, as the splits
  share no question text) is one column of the table rather than a fact to have memorised."""
  if symbol not in "+-" or left.denominator != 1 or right.denominator != 1 or left < 0 or right < 0:
    return []
  a, b = int(left), int(right)
  if symbol == "+":
    return [f"{a} + {b}, digit by digit from the right:", *_column_add(a, b, count)]
  if a >= b:
    return [f"{a} - {b}, digit by digit from the right:", *_column_sub(a, b, count)]
  return [f"{a} - {b} = -({b} - {a}); {b} - {a}, digit by digit from the right:", *_column_sub(b, a, count),
          f"{b} - {a} = {b - a}"]


def _eval(node: ast.AST, steps: list[str], count: bool = False) -> Fraction:
  """Exact value of an arithmetic AST, appending one line per operation (innermost first);
  count: + and - columns are counted unit by unit first (the max tier's working)."""
  if isinstance(node, ast.Constant) and isinstance(node.value, int):
    return Fraction(node.value)
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
    value = _eval(node.operand, steps, count)
    if isinstance(node.op, ast.UAdd):
      return value
    if not isinstance(node.operand, ast.Constant):  # a negated group is a step; -7 is a number
      steps.append(f"-({_fmt(value)}) = {_fmt(-value)}")
    return -value
  if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
    left, right = _eval(node.left, steps, count), _eval(node.right, steps, count)
    symbol, fn = _OPS[type(node.op)]
    if symbol == "/" and right == 0:
      raise ZeroDivisionError
    value = fn(left, right)
    steps.extend(_column_steps(left, symbol, right, value, count))
    steps.append(f"{_fmt(left)} {symbol} {_fmt(right)} = {_fmt(value)}")
    return value
  raise ValueError(f"unsupported expression node {ast.dump(node)}")


def _solve_expression(item: dict[str, Any], count: bool = False) -> tuple[str, Fraction] | None:
  """Steps of an arithmetic expression in the usual order (parentheses, * and /, left to right)."""
  expression = item["metadata"]["expression"]
  steps: list[str] = []
  try:
    value = _eval(ast.parse(expression.replace("×", "*"), mode="eval").body, steps, count)
  except ZeroDivisionError:
    return None
  lines = "\n".join(steps) if steps else f"{expression} = {_fmt(value)}"
  return f"Evaluate {expression} step by step, * and / before + and -, left to right:\n{lines}", value


def _euclid(a: int, b: int, lines: list[str]) -> int:
  while b:
    lines.append(f"{a} = {a // b} × {b} + {a % b}")
    a, b = b, a % b
  return a


def _solve_gcd(item: dict[str, Any]) -> tuple[str, Fraction]:
  numbers = item["metadata"]["numbers"]
  lines, g = [], numbers[0]
  for n in numbers[1:]:
    lines.append(f"gcd({g}, {n}) by Euclid's algorithm:")
    g = _euclid(max(g, n), min(g, n), lines)
    lines.append(f"so gcd = {g}")
  return "\n".join(lines), Fraction(g)


def _solve_lcm(item: dict[str, Any]) -> tuple[str, Fraction]:
  numbers = item["metadata"]["numbers"]
  lines, acc = [], numbers[0]
  for n in numbers[1:]:
    g = math.gcd(acc, n)
    new = acc * n // g
    lines.append(f"lcm({acc}, {n}) = {acc} × {n} / gcd({acc}, {n}) = {acc * n} / {g} = {new}")
    acc = new
  return "\n".join(lines), Fraction(acc)


def _solve_legs(item: dict[str, Any]) -> tuple[str, Fraction]:
  from reasoning_gym.arithmetic.leg_counting import ANIMALS

  lines, total = [], 0
  for animal, count in item["metadata"]["animals"].items():
    legs = ANIMALS[animal]
    lines.append(f"{count} × {animal} with {legs} legs each = {count * legs}")
    total += count * legs
  lines.append(f"Total: {' + '.join(line.rsplit(' = ', 1)[1] for line in lines)} = {total}")
  return "\n".join(lines), Fraction(total)


def _solve_letters(item: dict[str, Any]) -> tuple[str, Fraction]:
  letter, words = item["metadata"]["target_letter"], item["metadata"]["span"]
  counts = [(w, w.lower().count(letter)) for w in words]
  lines = [f'"{w}": {c}' for w, c in counts]
  total = sum(c for _, c in counts)
  lines.append(f"Total: {' + '.join(str(c) for _, c in counts)} = {total}")
  return f'Count "{letter}" word by word (ignoring case):\n' + "\n".join(lines), Fraction(total)


def _solve_equation(item: dict[str, Any]) -> tuple[str, Fraction] | None:
  import sympy

  x = sympy.Symbol(item["metadata"]["variable"])
  lhs, rhs = (sympy.sympify(side) for side in item["metadata"]["equation"].split("="))
  poly = sympy.Poly(sympy.expand(lhs - rhs), x)
  if poly.degree() != 1:
    return None
  a, b = (int(c) for c in poly.all_coeffs())  # a·x + b = 0
  value = Fraction(-b, a)
  text = (f"{item['metadata']['equation']}\nMove everything to one side: {a}*{x} + ({b}) = 0\n"
          f"{a}*{x} = {-b}\n{x} = {-b} / {a} = {_fmt(value)}")
  return text, value


def _solve_gsm(item: dict[str, Any]) -> tuple[str, Fraction] | None:
  cot = item["metadata"].get("answer_cot", "")
  if _FLOAT_NOISE.search(cot):
    return None  # a chain of thought with float round-off (26.499999999999996) teaches noise
  lines = [line for line in cot.splitlines() if not line.startswith("####")]
  value = parse_number(str(item["answer"]))
  if not lines or value is None:
    return None
  return "\n".join(lines), Fraction(str(value))


SOLVERS: Mapping[str, Callable[[dict[str, Any]], tuple[str, Fraction] | None]] = {
  "chain_sum": _solve_expression, "basic_arithmetic": _solve_expression, "products": _solve_expression,
  "gcd": _solve_gcd, "lcm": _solve_lcm, "leg_counting": _solve_legs, "letter_counting": _solve_letters,
  "simple_equations": _solve_equation, "gsm_symbolic": _solve_gsm,
}


# ---- generation ----------------------------------------------------------------------------


@functools.cache
def _reasoning_gym():
  import reasoning_gym  # imported on first use: it loads every dataset module (~2 s)

  return reasoning_gym


def rg_item(name: str, config: Mapping[str, Any], rg_seed: int) -> tuple[Any, dict[str, Any]]:
  """reasoning-gym's dataset of one item and that item (rebuildable from a task's meta)."""
  dataset = _reasoning_gym().create_dataset(name, seed=rg_seed, size=1, **config)
  return dataset, dataset[0]


def level_weights(difficulty: int, weights: Mapping[str, float] | None = None) -> dict[str, float]:
  """The datasets a level draws from with their weights (> 0); errors name what is allowed."""
  weights = DEFAULT_WEIGHTS if weights is None else weights
  unknown = set(weights) - set(SOLVERS)
  if unknown:
    raise ValueError(f"unknown math dataset(s) {sorted(unknown)} in weights; known: {', '.join(SOLVERS)}")
  out = {name: float(weights.get(name, 0.0)) for name in LEVELS[difficulty]}
  out = {name: w for name, w in out.items() if w > 0}
  if not out:
    raise ValueError(f"weights give math level {difficulty} nothing to draw: it offers "
                     f"{', '.join(LEVELS[difficulty])}; give at least one of them a weight > 0")
  return out


def _equation_key(metadata: Mapping[str, Any]) -> tuple[int, ...] | None:
  """A linear equation as the coefficients of a·x + b = 0 with a > 0 (None if it is not one)."""
  import sympy

  x = sympy.Symbol(metadata["variable"])
  try:
    lhs, rhs = (sympy.sympify(side) for side in metadata["equation"].split("="))
    coeffs = [int(c) for c in sympy.Poly(sympy.expand(lhs - rhs), x).all_coeffs()]
  except (ValueError, TypeError, sympy.SympifyError, sympy.PolynomialError):
    return None
  return tuple(-c for c in coeffs) if coeffs[0] < 0 else tuple(coeffs)


def _commuted_key(expression: str) -> tuple | None:
  """A sum or a product of plain numbers (`12 + 7 + 30`, `4 * 9`) by its sorted terms; None for
  any other expression (a difference or a mix of operators depends on the order)."""
  parts = expression.split()
  terms, ops = parts[::2], set(parts[1::2])
  if len(parts) % 2 == 0 or ops not in ({"+"}, {"*"}) or not all(t.isdigit() for t in terms):
    return None
  return ("sum" if ops == {"+"} else "products", tuple(sorted(int(t) for t in terms)))


def split_key(name: str, item: Mapping[str, Any]) -> tuple:
  """What a question is, for its split: its text, except where two texts pose one problem.

  Operands in another order (12 + 7 and 7 + 12, 4 * 5 and 5 * 4, gcd(26, 6) and gcd(6, 26), the
  same animals listed in another order) and another letter or side for the unknown (`Solve for j:
  4*j + 14 = 86`, `Solve for y: 86 = 14 + 4*y`) are one problem: keyed by the text, 35% of
  held-out level-0 sums and 21% of held-out level-1 questions were a train question with its
  operands swapped.
  """
  metadata = item["metadata"]
  if name in ("chain_sum", "basic_arithmetic") and (key := _commuted_key(metadata["expression"])):
    return (DOMAIN,) + key
  if name in ("gcd", "lcm"):
    return (DOMAIN, name, tuple(sorted(metadata["numbers"])))
  if name == "products":
    return (DOMAIN, "products", tuple(sorted(int(x) for x in re.split(r"[*×]", metadata["expression"]))))
  if name == "leg_counting":
    return (DOMAIN, name, tuple(sorted(metadata["animals"].items())))
  if name == "simple_equations" and (key := _equation_key(metadata)) is not None:
    return (DOMAIN, name, key)
  return (DOMAIN, item["question"])


def _seed_for(rng: random.Random, split: str) -> int:
  """A reasoning-gym seed whose lowest bit is the split: train and heldout never share one."""
  return 2 * rng.randrange(2**31) + (split == "heldout")


def _draw(split: str, difficulty: int, seed: int, index: int, mix: dict[str, float]) -> dict[str, Any]:
  """One well-posed question of `split`, with its solution; redrawn until both hold."""
  rng = common.task_rng(DOMAIN, split, difficulty, seed, index)
  names, w = list(mix), list(mix.values())
  for _ in range(_MAX_DRAWS):
    name = rng.choices(names, w)[0]
    rg_seed = _seed_for(rng, split)
    config = dict(LEVELS[difficulty][name])
    _, item = rg_item(name, config, rg_seed)
    if common.split_of(split_key(name, item)) != split:
      continue
    solved = SOLVERS[name](item)
    if solved is None:
      continue  # e.g. an expression whose true value is not reasoning-gym's floor division
    thinking, value = solved
    if abs(value) > MAX_ABS_ANSWER:
      continue
    if not answers_match(_fmt(value), item["answer"]):
      if name == "basic_arithmetic":
        continue  # its `/` is floor division; such items read as true division: ill-posed
      raise RuntimeError(f"{name} (seed {rg_seed}): our worked value {_fmt(value)} disagrees with "
                         f"reasoning-gym's answer {item['answer']!r} for {item['question']!r}")
    counted = _solve_expression(item, count=True)[0] if SOLVERS[name] is _solve_expression else None
    return {"name": name, "config": config, "rg_seed": rg_seed, "item": item, "thinking": thinking,
            "counted": counted, "answer": str(item["answer"])}
  raise RuntimeError(f"no {split} question at math level {difficulty} after {_MAX_DRAWS} draws")


def thinking_by_tier(worked: str, answer: str, counted: str | None = None) -> dict[str, str]:
  """How deep to think at each tier: `low` states only the worked solution's last line (the
  result, no working), `high` the whole worked solution, `max` the slowest careful route:
  `counted` where given (the same working with every + and - column first counted unit by
  unit, from the successor alone rather than recalled from the digit table), else the worked
  solution and a second pass through it as a check."""
  lines = worked.splitlines()
  end = f"So the answer is {answer}."
  slow = counted if counted and counted != worked else f"{worked}\nCheck, working it again:\n{worked}"
  return {"low": f"{lines[-1]}\n{end}", "high": f"{worked}\n{end}", "max": f"{slow}\n{end}"}


def generate(*, split: str, difficulty: int, n: int, seed: int = 0,
             weights: Mapping[str, float] | None = None) -> list[Task]:
  """`n` math tasks, deterministic in (split, difficulty, seed, weights).

  Args:
    weights: {reasoning-gym dataset: relative weight}; default `DEFAULT_WEIGHTS`.
  """
  common.check_args(DOMAIN, split, difficulty, MAX_DIFFICULTY, seed, n)
  mix = level_weights(difficulty, weights)
  tasks = []
  for i in range(n):
    d = _draw(split, difficulty, seed, i, mix)
    obj = {"id": common.task_id(DOMAIN, split, difficulty, seed, i), "domain": DOMAIN,
           "prompt": f"{d['item']['question'].rstrip()}\n\n{ANSWER_FORMAT}", "answer": d["answer"],
           "max_turns": MAX_TURNS,
           "oracle": [dict(common.turn(thinking=f"{d['thinking']}\nSo the answer is {d['answer']}.",
                                       content=f"<answer>{d['answer']}</answer>"),
                           thinking_by_tier=thinking_by_tier(d["thinking"], d["answer"], d["counted"]))],
           "meta": common.meta(DOMAIN, split, difficulty, seed, source=d["name"], rg_seed=d["rg_seed"],
                               rg_config=d["config"])}
    tasks.append(parse_task(obj, obj["id"]))
  return tasks


def wrong_answer(answer: str | int | float) -> str:
  """A different number of the same kind (an off-by-one, the commonest slip)."""
  value = parse_number(answer)
  if value is None:
    return f"not {answer}"
  try:
    exact = Fraction(str(answer).strip())
  except ValueError:
    exact = Fraction(value)
  return _fmt(exact + 1)


def corrupt_oracle(task: Task) -> list[dict[str, Any]]:
  """The oracle's reasoning with a wrong final answer, which must score 0."""
  turns = [dict(t) for t in task.oracle]
  turns[-1] = {**turns[-1], "content": f"<answer>{wrong_answer(task['answer'])}</answer>"}
  return turns
