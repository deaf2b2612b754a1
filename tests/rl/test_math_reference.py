"""Math answers recomputed from the prompt's text alone (each test names the mistake it catches).

The generator checks its worked value against reasoning-gym's answer, and the replay tests grade
the oracle against the task's answer; neither reads the question the model is shown. Here the
question text is evaluated again by plain Python (exact fractions, `math.gcd`, `str.count`, a
linear equation's root from two evaluations), so a prompt that poses another problem than the
answer solves fails.
"""

import math
import re
from fractions import Fraction

import pytest

from rl.tasks.answers import answers_match, extract_answer
from rl.tasks.generators import math as gen


def _exact(expression, x=None):
  """The exact value of + - * / ( ) over integers (and the unknown x), by Python on Fractions."""
  code = re.sub(r"\d+", lambda m: f"Fraction({m[0]})", expression.replace("×", "*"))
  code = re.sub(r"\b[a-zA-Z]\b", "x", code)
  return eval(code, {"Fraction": Fraction, "x": x})  # our own test text, never model output


def _numbers(text):
  return [int(n) for n in text.split(", ")]


def _reference(question):
  """The answer by plain Python for the question kinds whose text states the whole problem; None for
  word problems (legs, GSM), whose facts are not in the text."""
  if m := re.fullmatch(r"State the final answer to the following arithmetic problem: (.+) =", question):
    return _exact(m[1])
  if m := re.fullmatch(r"Solve the following multiplication: (.+)\. Give only the result as your final "
                       r"answer\.", question):
    return _exact(m[1])
  if m := re.fullmatch(r"Calculate (.+)\.", question):
    return _exact(m[1])
  if m := re.fullmatch(r"Find the Greatest Common Divisor \(GCD\) of these numbers: ([\d, ]+)\. Give only "
                       r"the GCD as your final answer\.", question):
    return math.gcd(*_numbers(m[1]))
  if m := re.fullmatch(r"Find the Least Common Multiple \(LCM\) of these numbers: ([\d, ]+)", question):
    return math.lcm(*_numbers(m[1]))
  if m := re.fullmatch(r'How many times does the letter "(\w)" appear in the text: "(.*)"\?', question):
    return m[2].lower().count(m[1].lower())
  if m := re.fullmatch(r"[^:=]* (\w)\b[^:=]*: ([^=]+) = ([^=]+)", question):  # "Solve for x: ...", ...
    f0 = _exact(m[2], Fraction(0)) - _exact(m[3], Fraction(0))
    f1 = _exact(m[2], Fraction(1)) - _exact(m[3], Fraction(1))
    return -f0 / (f1 - f0)  # the root of the linear f(x) = f0 + (f1 - f0) x
  return None


def _show(value):
  return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


@pytest.mark.parametrize("level", range(gen.MAX_DIFFICULTY + 1))
def test_answers_are_the_question_evaluated_by_plain_python(level):
  """Catches a task whose answer solves another problem than its prompt states, an oracle that
  answers anything but the task's answer, and a level that stops drawing its stated problems."""
  checked = 0
  for split in ("train", "heldout"):
    for task in gen.generate(split=split, difficulty=level, n=30, seed=5):
      question = task.prompt.removesuffix(f"\n\n{gen.ANSWER_FORMAT}")
      assert question != task.prompt
      want = _reference(question)
      given = extract_answer(task.oracle[-1]["content"])
      assert given == task["answer"], task.id
      # Above 1e8 the grader's relative 1e-9 would pass a non-integer answer 0.1 off: such are redrawn.
      assert abs(Fraction(task["answer"])) <= 10**8, (task.id, task["answer"])
      if want is None:
        assert task.meta["source"] in ("leg_counting", "gsm_symbolic"), (task.id, question)
        continue
      want = Fraction(want)
      assert answers_match(task["answer"], _show(want)), (task.id, question, task["answer"], want)
      assert not answers_match(task["answer"], _show(want + 1)), task.id
      checked += 1
  assert checked >= 20  # level 4 is about half word problems


def test_level_zero_is_one_sum_or_difference_of_two_small_numbers():
  """Catches level 0 drawing longer chains, three-digit numbers or products."""
  for task in gen.generate(split="train", difficulty=0, n=60, seed=6):
    question = task.prompt.removesuffix(f"\n\n{gen.ANSWER_FORMAT}")
    m = re.fullmatch(r"State the final answer to the following arithmetic problem: "
                     r"(\d{1,2}) ([+-]) (\d{1,2}) =", question)
    assert m, question
    a, b = int(m[1]), int(m[3])
    assert int(task["answer"]) == (a + b if m[2] == "+" else a - b)


def test_low_tier_states_the_result_line():
  """Catches the `low` tier stating the first line of the working (a step, not the result)."""
  worked = "Evaluate 3 * 4 + 5 step by step:\n3 * 4 = 12\n12 + 5 = 17"
  tiers = gen.thinking_by_tier(worked, "17")
  assert tiers["low"] == "12 + 5 = 17\nSo the answer is 17."
  assert tiers["high"] == worked + "\nSo the answer is 17."


def test_gsm_chain_of_thought_with_float_noise_is_refused():
  """Catches a GSM item whose chain of thought shows float round-off (26.499999999999996) being
  kept as an oracle; a clean one is kept, without its '####' answer line."""
  def item(cot):
    return {"answer": "26.5", "metadata": {"answer_cot": cot}}

  assert gen._solve_gsm(item("He pays 53 / 2 = 26.499999999999996 dollars.\n#### 26.5")) is None
  assert gen._solve_gsm(item("He pays 53 / 2 = 26.500000001 dollars.\n#### 26.5")) is None
  clean = "He pays 53 / 2 = 26.5 dollars."
  assert gen._solve_gsm(item(f"{clean}\n#### 26.5")) == (clean, Fraction(53, 2))


def test_leg_counting_key_ignores_the_order_of_the_animals():
  """Catches the same animals listed in another order keyed as another problem (so one problem
  could be drawn in both splits)."""
  def item(animals):
    text = ", ".join(f"{n} {a}s" for a, n in animals.items())
    return {"question": f"how many legs are there in total if you have {text}?",
            "metadata": {"animals": animals}}

  one = gen.split_key("leg_counting", item({"dog": 3, "ant": 2, "cow": 1}))
  assert one == gen.split_key("leg_counting", item({"cow": 1, "dog": 3, "ant": 2}))
  assert one != gen.split_key("leg_counting", item({"cow": 2, "dog": 3, "ant": 1}))


def test_an_equation_is_one_problem_whatever_its_letter_or_side():
  """Catches `4*j + 14 = 86` and `86 = 14 + 4*y` keyed as two problems (a·x + b = 0 and its negation)."""
  def item(equation, variable):
    return {"question": f"Solve for {variable}: {equation}",
            "metadata": {"equation": equation, "variable": variable}}

  one = gen.split_key("simple_equations", item("4*j + 14 = 86", "j"))
  assert one == gen.split_key("simple_equations", item("86 = 14 + 4*y", "y"))
  assert one != gen.split_key("simple_equations", item("4*y + 14 = 87", "y"))


def test_a_negative_number_is_no_step_of_the_working():
  """Catches `-7` written as a negation step `-(7) = -7`; a negated group is one."""
  thinking, value = gen._solve_expression({"metadata": {"expression": "-7 + -( 2 * 3 )"}})
  assert value == -13
  assert thinking.splitlines()[1:] == ["2 * 3 = 6", "-(6) = -6", "-7 + -6 = -13"]
