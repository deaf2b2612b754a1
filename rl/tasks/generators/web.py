"""Web tasks: questions answered by searching and reading an offline site.

Levels:
  0  one hop on a small synthetic wiki: search the entity, open its page, read a fact.
  1  one hop on long pages: the fact sits on a later page of the document; `find` locates it.
  2  two hops: follow one link (the founder of a company, the city of a person, ...).
  3  three hops: follow two links, on long pages.
  4  the real `python-docs` corpus (rl/tools/corpora.py): the module that defines a function
     or class, or a parameter's default value, verified against the corpus text.

Each task at levels 0-3 ships its own wiki (`pages`): cities, countries, people and companies
with attributes and markdown links, drawn from a seeded RNG. Every entity name belongs to one
split (`common.split_of`), so train and heldout share no entity. Level 4 reads the same real
corpus in both splits (training on it is how the policy meets real text), but the functions and
classes asked about are split the same way, so heldout questions are never trained on.

The oracle trajectory is built by running the real tools on the task's site, and every step
is checked (the target is among the search results, the next link is on the opened page, the
answer is in the text shown), so replaying it must score 1.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable
from typing import Any

from rl.tasks.generators import common
from rl.tasks.schema import Task, parse_task
from rl.tools import corpora, search

DOMAIN = "web"
MAX_DIFFICULTY = 4
SITE_URL = "https://wiki.local/"
INSTRUCTIONS = ("Use the search, open and find tools to look it up on the offline site. Finish with "
                "the answer alone inside <answer></answer>.")

_ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "h", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t",
           "th", "tr", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ai", "ei", "ou")
_CODAS = ("", "", "", "n", "r", "l", "s", "m", "nd", "rk", "th")
_CITY_ENDS = ("", "", "ford", "ton", "burg", "mouth", "dale", "haven")
_COUNTRY_ENDS = ("ia", "land", "ova", "istan", "ar")
_COMPANY_KINDS = ("Motors", "Labs", "Foods", "Systems", "Textiles", "Shipping", "Energy", "Pharma")
_INDUSTRIES = {"Motors": "automotive", "Labs": "research", "Foods": "food processing",
               "Systems": "software", "Textiles": "textiles", "Shipping": "logistics", "Energy": "energy",
               "Pharma": "pharmaceuticals"}
_OCCUPATIONS = ("engineer", "chemist", "architect", "economist", "physician", "novelist", "geologist",
                "composer", "lawyer", "astronomer")
_CONTINENTS = ("Europe", "Asia", "Africa", "South America", "North America", "Oceania")
_FILLER = (
  "Early records mention {n} only briefly.",
  "Over the following decades {n} became better known across the surrounding region.",
  "Local historians disagree about several details of this period, and archives remain incomplete.",
  "A series of reforms reshaped the institutions associated with {n}.",
  "Visitors often remark on the architecture and the long tradition of public festivals.",
  "Several notable buildings were restored after a fire damaged the old quarter.",
  "Accounts of {n} often mention markets, museums and a lively music scene.",
  "Commentators have described {n} as quietly influential in its field.",
  "An archive of letters from this era was catalogued and opened to researchers.",
  "Debates over planning and transport dominated local politics for many years.",
  "Its reputation rests partly on a strong culture of apprenticeship and craft.",
  "Later accounts emphasise continuity rather than sudden change.",
)


# ---- the synthetic wiki ---------------------------------------------------------------------


def _word(rng: random.Random, syllables: int) -> str:
  word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)) + rng.choice(_CODAS)
  return word.capitalize()


class _Names:
  """Unique entity names of one split: a name of the other split is never drawn."""

  def __init__(self, rng: random.Random, split: str):
    self.rng, self.split, self.used = rng, split, set()

  def draw(self, make: Callable[[random.Random], str]) -> str:
    while True:
      name = make(self.rng)
      words = {w.lower() for w in name.split()}
      if name not in self.used and not words & self._used_words() and common.split_of(
          ("web-entity", name)) == self.split:
        self.used.add(name)
        return name

  def _used_words(self) -> set[str]:
    generic = {k.lower() for k in _COMPANY_KINDS}
    return {w.lower() for n in self.used for w in n.split()} - generic


def _entity(kind: str, name: str, **facts: Any) -> dict[str, Any]:
  return {"kind": kind, "name": name, "url": SITE_URL + name.replace(" ", "_"), "facts": facts}


def build_world(rng: random.Random, split: str, size: int) -> dict[str, dict[str, Any]]:
  """Entities by name: countries, cities, people, companies, linked by relations.

  Relations (values are entity names): city.country, country.capital, person.birthplace,
  company.founder, company.headquarters. Attributes are numbers or plain strings.
  """
  names = _Names(rng, split)
  world: dict[str, dict[str, Any]] = {}
  countries = [names.draw(lambda r: _word(r, r.choice((1, 2))) + r.choice(_COUNTRY_ENDS).lower())
               for _ in range(max(2, size // 3))]
  cities = [names.draw(lambda r: _word(r, r.choice((1, 2))) + r.choice(_CITY_ENDS)) for _ in range(size)]
  people = [names.draw(lambda r: f"{_word(r, 2)} {_word(r, r.choice((2, 3)))}") for _ in range(size)]
  companies = [names.draw(lambda r: f"{_word(r, 2)} {r.choice(_COMPANY_KINDS)}") for _ in range(size)]
  for country in countries:
    currency = f"{country[:4].rstrip('aeiou')}an {rng.choice(('crown', 'mark', 'dinar'))}"
    world[country] = _entity("country", country, continent=rng.choice(_CONTINENTS),
                             population=rng.randrange(1_000, 90_000) * 1000, currency=currency)
  for i, city in enumerate(cities):
    country = countries[i % len(countries)] if i < len(countries) else rng.choice(countries)
    world[city] = _entity("city", city, country=country, population=rng.randrange(200, 50_000) * 100,
                          founded=rng.randrange(800, 1900))
  for country in countries:
    world[country]["facts"]["capital"] = next(c for c in cities if world[c]["facts"]["country"] == country)
  for person in people:
    world[person] = _entity("person", person, born=rng.randrange(1900, 1976), birthplace=rng.choice(cities),
                            occupation=rng.choice(_OCCUPATIONS))
  for company in companies:
    founder = rng.choice(people)
    world[company] = _entity("company", company, founder=founder, headquarters=rng.choice(cities),
                             founded=world[founder]["facts"]["born"] + rng.randrange(22, 40),
                             employees=rng.randrange(20, 40_000),
                             industry=_INDUSTRIES[company.split()[-1]])
  return world


# label on the page, phrase "the X of {}", question for an attribute.
_FACTS = {
  "country": {"continent": "Continent", "population": "Population", "currency": "Currency",
              "capital": "Capital"},
  "city": {"country": "Country", "population": "Population", "founded": "Founded"},
  "person": {"born": "Born", "birthplace": "Birthplace", "occupation": "Occupation"},
  "company": {"founder": "Founder", "headquarters": "Headquarters", "founded": "Founded",
              "employees": "Employees", "industry": "Industry"},
}
_RELATIONS = {("country", "capital"), ("city", "country"), ("person", "birthplace"), ("company", "founder"),
              ("company", "headquarters")}
_HOP_PHRASE = {"capital": "the capital of {}", "country": "the country that {} lies in",
               "birthplace": "the birthplace of {}", "founder": "the founder of {}",
               "headquarters": "the city where {} has its headquarters"}
_QUESTION = {
  ("country", "continent"): "On which continent is {}?",
  ("country", "population"): "What is the population of {}?",
  ("country", "currency"): "What is the currency of {}?",
  ("country", "capital"): "What is the capital of {}?",
  ("city", "country"): "In which country is {}?",
  ("city", "population"): "What is the population of {}?",
  ("city", "founded"): "In what year was {} founded?",
  ("person", "born"): "In what year was {} born?",
  ("person", "birthplace"): "In which city was {} born?",
  ("person", "occupation"): "What is the occupation of {}?",
  ("company", "founder"): "Who founded {}?",
  ("company", "headquarters"): "In which city is {} headquartered?",
  ("company", "founded"): "In what year was {} founded?",
  ("company", "employees"): "How many employees does {} have?",
  ("company", "industry"): "In which industry does {} work?",
}


def _fmt(value: Any, world: dict[str, dict[str, Any]]) -> str:
  if isinstance(value, str) and value in world:
    return f"[{value}]({world[value]['url']})"
  if isinstance(value, int) and value >= 10_000:
    return f"{value:,}"
  return str(value)


def _intro(entity: dict[str, Any], world: dict[str, dict[str, Any]]) -> str:
  f, link = entity["facts"], lambda key: _fmt(entity["facts"][key], world)
  name = entity["name"]
  if entity["kind"] == "country":
    return f"{name} is a country in {f['continent']}. Its capital is {link('capital')}."
  if entity["kind"] == "city":
    return f"{name} is a city in {link('country')}."
  if entity["kind"] == "person":
    article = "an" if f["occupation"][0] in "aeiou" else "a"
    return f"{name} is {article} {f['occupation']} from {link('birthplace')}."
  return f"{name} is a company in the {f['industry']} industry, founded by {link('founder')}."


def page_of(entity: dict[str, Any], world: dict[str, dict[str, Any]], rng: random.Random,
            filler: int) -> dict[str, str]:
  """An entity's page: intro, `filler` sentences of history, then a Facts list (one fact a line)."""
  lines = [f"# {entity['name']}", "", _intro(entity, world), ""]
  if filler:
    lines += ["## History", ""]
    sentences = [rng.choice(_FILLER).format(n=entity["name"]) for _ in range(filler)]
    lines += [" ".join(sentences[i:i + 3]) + "\n" for i in range(0, len(sentences), 3)]
  lines += ["## Facts", ""]
  for key, label in _FACTS[entity["kind"]].items():
    lines.append(f"- {label}: {_fmt(entity['facts'][key], world)}")
  return {"url": entity["url"], "title": entity["name"], "text": "\n".join(lines) + "\n"}


def _path(rng: random.Random, world: dict[str, dict[str, Any]], hops: int) -> tuple[list[str], str] | None:
  """A start entity, `hops` relations without revisiting an entity, and a final attribute."""
  start = rng.choice(sorted(world))
  path, keys = [start], []
  for _ in range(hops):
    entity = world[path[-1]]
    options = [k for k in _FACTS[entity["kind"]] if (entity["kind"], k) in _RELATIONS
               and entity["facts"][k] not in path]
    if not options:
      return None
    key = rng.choice(options)
    keys.append(key)
    path.append(entity["facts"][key])
  last = world[path[-1]]
  options = [k for k in _FACTS[last["kind"]] if last["facts"][k] not in path]
  return (path, keys + [rng.choice(options)]) if options else None


def _question(world: dict[str, dict[str, Any]], path: list[str], keys: list[str]) -> str:
  subject = path[0]
  for key in keys[:-1]:
    subject = _HOP_PHRASE[key].format(subject)
  question = _QUESTION[(world[path[-1]]["kind"], keys[-1])].format(subject)
  return question[0].upper() + question[1:]


# ---- oracle: run the real tools and check every step -----------------------------------------


class _Oracle:
  """Builds an oracle trajectory by calling the tools on the task's site, checking each result."""

  def __init__(self, site: search.Site):
    self.browser, self.turns = search.Browser(site), []

  def call(self, thinking: str, name: str, **arguments: Any) -> str:
    self.turns.append(common.turn(thinking, calls=[(name, arguments)]))
    return self.browser.call(name, arguments)

  def answer(self, thinking: str, answer: Any) -> list[dict[str, Any]]:
    self.turns.append(common.turn(thinking, content=f"<answer>{answer}</answer>"))
    return self.turns


@dataclasses.dataclass(frozen=True)
class _Draw:
  """One drawn task: `pages` None means the python-docs corpus; `subjects` are the entities asked about."""
  question: str
  answer: str | int | float
  turns: list[dict[str, Any]]
  pages: list[dict[str, str]] | None
  distractor: Any
  subjects: list[str]


class _Unverified(Exception):
  """The tools do not lead to the answer for this draw (the generator draws again)."""


def _check(cond: bool) -> None:
  if not cond:
    raise _Unverified


def _read_fact(oracle: _Oracle, entity: dict[str, Any], key: str, world: dict[str, dict[str, Any]],
               long: bool) -> str:
  """Opens the entity's page (already known by url) and reads a fact; returns the line read."""
  label = _FACTS[entity["kind"]][key]
  shown = oracle.call(f"I open the page of {entity['name']}.", "open", url=entity["url"])
  line = f"- {label}: {_fmt(entity['facts'][key], world)}"
  if long:
    _check("page 0 of 1 " not in shown)
    found = oracle.call(f"The page is long; I look for the line with '{label}:'.", "find", text=f"{label}:")
    _check(line in found and found.startswith("1 line(s)"))
  else:
    _check(line in shown)
  return line


def _wiki_task(rng: random.Random, split: str, difficulty: int) -> _Draw:
  hops = {0: 0, 1: 0, 2: 1, 3: 2}[difficulty]
  long = difficulty in (1, 3)
  world = build_world(rng, split, size=4 + 2 * difficulty)
  route = _path(rng, world, hops)
  _check(route is not None)
  path, keys = route
  # Long pages (levels 1, 3): the pages on the path and a few others, so a long page is no hint and
  # the task file stays small (every page long would make a level-3 task ~100 kB).
  long_names = set(path) | set(rng.sample(sorted(world), 3)) if long else set()
  pages = [page_of(world[n], world, rng, filler=rng.randrange(30, 45) if n in long_names else 0)
           for n in sorted(world)]
  rng.shuffle(pages)
  oracle = _Oracle(search.Site(pages))
  start = world[path[0]]
  results = oracle.call(f"I search for {start['name']}.", "search", query=start["name"])
  _check(f"1. {start['name']}\n   url: {start['url']}" in results)
  for hop, (entity_name, key) in enumerate(zip(path, keys, strict=True)):
    line = _read_fact(oracle, world[entity_name], key, world, long)
    if hop < len(path) - 1:
      oracle.turns[-1]["thinking"] += f" I need {key} of {entity_name}; then I follow that link."
  answer = world[path[-1]]["facts"][keys[-1]]
  oracle.answer(f"The page says '{line}'. So the answer is {_fmt(answer, {})}.", _fmt(answer, {}))
  distractors = sorted({e["facts"][keys[-1]] for e in world.values() if keys[-1] in e["facts"]} - {answer})
  distractor = rng.choice(distractors) if distractors else None
  return _Draw(f"{_question(world, path, keys)} {INSTRUCTIONS}", answer, oracle.turns, pages, distractor,
               path)


# ---- level 4: the python-docs corpus --------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _doc_facts() -> dict[str, list[tuple]]:
  """Facts of python-docs: (module, name) pairs with a unique name; simple parameter defaults."""
  owners: dict[str, list[str]] = {}
  defaults = []
  for module in corpora.MODULES:
    for name, obj in corpora.members(module):
      owners.setdefault(name, []).append(module)
      sig = corpora.signature_of(obj)
      for param in (sig.parameters.values() if sig is not None else ()):
        value = param.default.text if param.default is not param.empty else None
        if value is not None and _simple_default(value):
          defaults.append((module, name, param.name, value))
  unique = [(mods[0], name) for name, mods in sorted(owners.items()) if len(mods) == 1]
  return {"module": unique, "default": defaults}


def _simple_default(text: str) -> bool:
  """A default an answer can state plainly: a number, True/False or a short word string."""
  if text in ("True", "False"):  # None is left out: it is most defaults, so a guess would win
    return True
  if text[:1] in "'\"" and text[-1:] == text[:1]:
    inner = text[1:-1]
    return 0 < len(inner) <= 20 and inner.replace("-", "").replace("_", "").isalnum()
  try:
    float(text)
  except ValueError:
    return False
  return True


def _default_answer(text: str) -> str | int | float:
  if text[:1] in "'\"":
    return text[1:-1]
  if text in ("True", "False", "None"):
    return text
  value = float(text)
  return int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value


def _docs_task(rng: random.Random, split: str) -> _Draw:
  facts = _doc_facts()
  kind = rng.choice(("module", "default"))
  pool = [f for f in facts[kind] if common.split_of(("web-pydoc", f"{f[0]}.{f[1]}")) == split]
  fact = rng.choice(pool)
  site = search.site_for(corpora.load_corpus("python-docs"),
                         key=f"corpus:python-docs:{corpora.corpus_version()}")
  oracle = _Oracle(site)
  url = f"{corpora.CORPUS_PREFIX}{fact[0]}.{fact[1]}"
  if kind == "module":
    module, name = fact
    results = oracle.call(f"I search the docs for {name}.", "search", query=name)
    _check(f"url: {url}\n" in results)
    shown = oracle.call(f"The result {url} looks right; I open it to see its module.", "open", url=url)
    _check(f"Module: [{module}]" in shown)
    oracle.answer(f"The page of {name} says 'Module: {module}'.", module)
    others = sorted({m for m, _ in facts["module"]} - {module})
    return _Draw(f"In the Python standard library documentation, which module defines `{name}`? Give the "
                 f"module's full dotted name. {INSTRUCTIONS}", module, oracle.turns, None, rng.choice(others),
                 [f"{module}.{name}"])
  module, name, param, text = fact
  results = oracle.call(f"I search the docs for {module}.{name}.", "search", query=f"{module}.{name}")
  _check(f"url: {url}\n" in results)
  oracle.call(f"I open {url}.", "open", url=url)
  found = oracle.call("I look for its signature.", "find", text="Signature:")
  _check(f"{param}={text}" in found and found.startswith("1 line(s)"))
  answer = _default_answer(text)
  oracle.answer(f"The signature shows {param}={text}.", answer)
  flip = {"True": "False", "False": "True"}
  wrong = answer + 1 if isinstance(answer, (int, float)) else flip.get(answer, "None")
  return _Draw(f"In the Python standard library documentation, what is the default value of the parameter "
               f"`{param}` of `{module}.{name}`? {INSTRUCTIONS}", answer, oracle.turns, None, wrong,
               [f"{module}.{name}"])


# ---- the generator interface ---------------------------------------------------------------


def _one(split: str, difficulty: int, seed: int, index: int) -> Task:
  rng = common.task_rng(DOMAIN, split, difficulty, seed, index)
  for _ in range(100):
    try:
      draw = _docs_task(rng, split) if difficulty == MAX_DIFFICULTY else _wiki_task(rng, split, difficulty)
      break
    except _Unverified:
      continue
  else:
    raise RuntimeError(f"web generator found no verifiable task for {split} d{difficulty} s{seed} i{index}")
  obj = {"id": common.task_id(DOMAIN, split, difficulty, seed, index), "domain": DOMAIN,
         "prompt": draw.question, "answer": draw.answer, "max_turns": len(draw.turns) + 4,
         "oracle": draw.turns,
         "meta": common.meta(DOMAIN, split, difficulty, seed, subjects=draw.subjects,
                             distractor=draw.distractor)}
  if draw.pages is None:
    obj["corpus"] = "python-docs"
    obj["meta"]["corpus_version"] = corpora.corpus_version()
  else:
    obj["pages"] = draw.pages
  return parse_task(obj, obj["id"])


def generate(*, split: str, difficulty: int, n: int, seed: int) -> list[Task]:
  """`n` web tasks of `split` at `difficulty` (see the module docstring for the levels)."""
  common.check_args(DOMAIN, split, difficulty, MAX_DIFFICULTY, seed, n)
  return [_one(split, difficulty, seed, i) for i in range(n)]


def corrupt_oracle(task: Task) -> list[dict[str, Any]]:
  """The oracle's searches and reads with a wrong final answer (another value of the same fact)."""
  turns = [dict(t) for t in task.oracle]
  wrong = task.meta.get("distractor")
  if wrong is None or str(wrong).lower() == str(task["answer"]).lower():
    wrong = task["answer"] + 1 if isinstance(task["answer"], (int, float)) else f"not {task['answer']}"
  turns[-1] = {**turns[-1], "content": f"<answer>{wrong}</answer>"}
  return turns

