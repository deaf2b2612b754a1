"""Terminal tasks: file-system chores graded by the final state of the task directory.

Each template draws its parameters (file names, contents, columns, keys) from the task's RNG;
the template name and parameters form the instance key whose hash (`common.split_of`) puts it
in exactly one split, so train and heldout never share an instance. A key names the instance,
not the order its parts were drawn in (a set of files is sorted): keyed by the draw order, one
set of three files to delete had six keys, and 82% of such instances could be drawn in both
splits. Levels:

  0  one short command: create, delete or rename a file, make a directory
  1  one command over a pattern: rename by extension, move by prefix, count matches, sort
  2  a real tool: cut a CSV column, sort -u, fix a config line, tar a directory
  3  several steps: a CSV report plus clean-up, archive-then-delete, a three-edit config fix

The oracle runs the solving command in the sandbox; `corrupt_oracle` runs a near miss (the
wrong flag, a missing step) that the state check must reject.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from rl.tasks.generators import common
from rl.tasks.schema import Task, parse_task

DOMAIN = "terminal"
MAX_DIFFICULTY = 3

_WORDS = ("apple", "birch", "cedar", "delta", "ember", "fjord", "grove", "harbor", "iris", "juniper",
          "kettle", "lantern", "maple", "nectar", "orbit", "pepper", "quartz", "raven", "saffron",
          "tundra", "umber", "violet", "walnut", "xenon", "yarrow", "zephyr", "amber", "basil", "coral",
          "dune", "falcon", "garnet", "hazel", "indigo", "jasper", "kelp", "lotus", "mango", "nutmeg",
          "olive")
_CITIES = ("oslo", "lima", "kyiv", "rome", "doha", "bern", "cairo", "delhi", "quito", "seoul")


class _Spec(dict):
  """A drawn template instance: prompt, files, check, solve and near-miss commands, key."""


def _words(rng: random.Random, k: int) -> list[str]:
  return rng.sample(_WORDS, k)


# ---- level 0 -------------------------------------------------------------------------------

def _create_file(rng):
  name, word = _words(rng, 2)
  return _Spec(key=(name, word), prompt=f"Create a file named {name}.txt whose content is the single line "
               f"'{word}' (followed by a newline).", files={},
               check={"files": {f"{name}.txt": word + "\n"}},
               solve=f"echo {word} > {name}.txt", miss=f"printf {word} > {name}.txt")


def _delete_file(rng):
  names = _words(rng, 3)
  files = {f"{n}.log": f"{n} log line\n" for n in names}
  victim = names[rng.randrange(3)]
  keep = {p: c for p, c in files.items() if p != f"{victim}.log"}
  other = next(p for p in keep)
  return _Spec(key=(tuple(sorted(names)), victim),
               prompt=f"Delete the file {victim}.log; keep the other files.", files=files,
               check={"files": keep, "absent": [f"{victim}.log"]},
               solve=f"rm {victim}.log", miss=f"rm {other}")


def _rename_file(rng):
  a, b, w = _words(rng, 3)
  return _Spec(key=(a, b, w), prompt=f"Rename the file {a}.txt to {b}.txt.", files={f"{a}.txt": f"{w}\n"},
               check={"files": {f"{b}.txt": f"{w}\n"}, "absent": [f"{a}.txt"]},
               solve=f"mv {a}.txt {b}.txt", miss=f"cp {a}.txt {b}.txt")


def _make_dir(rng):
  a, b = _words(rng, 2)
  return _Spec(key=(a, b), prompt=f"Create the directory {a}/{b} (including its parent).", files={},
               check={"command": f"test -d {a}/{b}"}, solve=f"mkdir -p {a}/{b}",
               miss=f"mkdir {a} && touch {a}/{b}")


# ---- level 1 -------------------------------------------------------------------------------

def _rename_ext(rng):
  names = _words(rng, rng.randint(3, 5))
  k = rng.randint(2, len(names) - 1)
  files = {f"{n}.txt": f"{n}\n" for n in names[:k]} | {f"{n}.csv": f"id,{n}\n" for n in names[k:]}
  want = {f"{n}.md": f"{n}\n" for n in names[:k]} | {f"{n}.csv": f"id,{n}\n" for n in names[k:]}
  last = sorted(names[:k])[-1]
  return _Spec(key=(tuple(sorted(names[:k])), tuple(sorted(names[k:]))),
               prompt="Rename every .txt file in the current directory to the same "
               "name with the extension .md (a.txt becomes a.md). Leave other files alone.", files=files,
               check={"files": want, "absent": [f"{n}.txt" for n in names[:k]]},
               solve='for f in *.txt; do mv "$f" "${f%.txt}.md"; done',
               miss=f'for f in *.txt; do [ "$f" = {last}.txt ] || mv "$f" "${{f%.txt}}.md"; done')


def _move_prefix(rng):
  names = _words(rng, rng.randint(4, 6))
  k = rng.randint(2, len(names) - 1)
  dest = rng.choice(("archive", "old", "reports"))
  files = {f"report_{n}.csv": f"x,{n}\n" for n in names[:k]} | {f"{n}.csv": f"y,{n}\n" for n in names[k:]}
  want = ({f"{dest}/report_{n}.csv": f"x,{n}\n" for n in names[:k]}
          | {f"{n}.csv": f"y,{n}\n" for n in names[k:]})
  return _Spec(key=(tuple(sorted(names[:k])), tuple(sorted(names[k:])), dest),
               prompt=f"Move every file whose name starts with 'report_' into a "
               f"new directory {dest}/ (keep the file names). Leave the other files where they are.",
               files=files, check={"files": want, "absent": [f"report_{n}.csv" for n in names[:k]]},
               solve=f"mkdir -p {dest} && mv report_* {dest}/",
               miss=f"mkdir -p {dest} && cp report_* {dest}/")


def _count_matches(rng):
  word = rng.choice(("ERROR", "WARN", "TIMEOUT"))
  lines, n = [], 0
  for i in range(rng.randint(6, 20)):
    hit = rng.random() < 0.4 or i == 0
    n += hit
    lines.append(f"{i:03d} {word if hit else 'INFO'} {rng.choice(_WORDS)}")
  rng.shuffle(lines)
  return _Spec(key=tuple(lines), prompt=f"Count the lines of log.txt that contain {word} and write just the "
               "number (and a newline) to count.txt.", files={"log.txt": "\n".join(lines) + "\n"},
               check={"files": {"count.txt": f"{n}\n"}}, solve=f"grep -c {word} log.txt > count.txt",
               miss="wc -l < log.txt > count.txt" if n != len(lines) else f"echo {n + 1} > count.txt")


def _sort_lines(rng):
  names = _words(rng, rng.randint(4, 9))
  return _Spec(key=tuple(names), prompt="Write the lines of names.txt sorted alphabetically to sorted.txt.",
               files={"names.txt": "\n".join(names) + "\n"},
               check={"files": {"sorted.txt": "\n".join(sorted(names)) + "\n"}},
               solve="sort names.txt > sorted.txt", miss="sort -r names.txt > sorted.txt")


# ---- level 2 -------------------------------------------------------------------------------

def _csv_table(rng) -> tuple[list[str], list[list[str]]]:
  header = ["name", "city", "age", "score"]
  rows = [[rng.choice(_WORDS), rng.choice(_CITIES), str(rng.randint(18, 80)), str(rng.randint(0, 100))]
          for _ in range(rng.randint(4, 9))]
  return header, rows


def _csv_text(header, rows) -> str:
  return "\n".join(",".join(r) for r in [header, *rows]) + "\n"


def _csv_column(rng):
  header, rows = _csv_table(rng)
  col = rng.randrange(len(header))
  values = "\n".join(r[col] for r in rows) + "\n"
  name = header[col]
  return _Spec(key=(_csv_text(header, rows), col),
               prompt=f"data.csv has a header line. Write the values of its "
               f"'{name}' column (without the header, in the original order, one per line) to {name}.txt.",
               files={"data.csv": _csv_text(header, rows)}, check={"files": {f"{name}.txt": values}},
               solve=f"tail -n +2 data.csv | cut -d, -f{col + 1} > {name}.txt",
               miss=f"cut -d, -f{col + 1} data.csv > {name}.txt")


def _sort_unique(rng):
  names = _words(rng, rng.randint(3, 6))
  lines = names + rng.sample(names, rng.randint(1, len(names)))
  rng.shuffle(lines)
  return _Spec(key=tuple(lines), prompt="Write the distinct lines of words.txt, sorted alphabetically, to "
               "unique.txt (each line once).", files={"words.txt": "\n".join(lines) + "\n"},
               check={"files": {"unique.txt": "\n".join(sorted(set(lines))) + "\n"}},
               solve="sort -u words.txt > unique.txt", miss="sort words.txt > unique.txt")


def _config(rng) -> dict[str, str]:
  keys = rng.sample(("port", "host", "workers", "timeout", "log_level", "cache_dir", "retries", "mode"), 5)
  vals = {"port": str(rng.randint(1024, 9999)), "host": rng.choice(("localhost", "0.0.0.0", "db.local")),
          "workers": str(rng.randint(1, 16)), "timeout": str(rng.randint(5, 120)),
          "log_level": rng.choice(("info", "debug", "warning")),
          "cache_dir": f"/var/cache/{rng.choice(_WORDS)}",
          "retries": str(rng.randint(0, 9)), "mode": rng.choice(("fast", "safe", "strict"))}
  return {k: vals[k] for k in keys}


def _conf_text(conf: dict[str, str]) -> str:
  return "# service configuration\n" + "".join(f"{k}={v}\n" for k, v in conf.items())


def _fix_config(rng):
  conf = _config(rng)
  key = rng.choice(list(conf))
  new = conf[key] + "0" if conf[key].isdigit() else conf[key] + "_new"
  fixed = dict(conf, **{key: new})
  return _Spec(key=(_conf_text(conf), key), prompt=f"In app.conf, change the value of '{key}' to '{new}'. "
               "Keep every other line exactly as it is.", files={"app.conf": _conf_text(conf)},
               check={"files": {"app.conf": _conf_text(fixed)}},
               solve=f"sed -i 's|^{key}=.*|{key}={new}|' app.conf", miss=f"echo '{key}={new}' >> app.conf")


def _tar_dir(rng):
  d = rng.choice(("project", "site", "notes", "data"))
  names = _words(rng, rng.randint(2, 4))
  files = {f"{d}/{n}.txt": f"{n} {rng.randint(0, 999)}\n" for n in names}
  check = (f"rm -rf /tmp/x && mkdir /tmp/x && tar -xzf {d}.tar.gz -C /tmp/x && diff -r /tmp/x/{d} {d} && "
           f"test \"$(ls /tmp/x)\" = {d}")
  return _Spec(key=(d, tuple(sorted(files.items()))),
               prompt=f"Create a gzip-compressed tar archive {d}.tar.gz "
               f"of the directory {d}; the paths inside the archive must start with {d}/. Keep {d} itself.",
               files=files, check={"files": files, "command": check},
               solve=f"tar -czf {d}.tar.gz {d}", miss=f"tar -czf {d}.tar.gz -C {d} .")


# ---- level 3 -------------------------------------------------------------------------------

def _csv_report(rng):
  header, rows = _csv_table(rng)
  col = rng.choice((0, 1))
  name = header[col]
  distinct = sorted({r[col] for r in rows})
  solve = (f"tail -n +2 data.csv | cut -d, -f{col + 1} | sort -u > {name}s.txt && "
           f"wc -l < {name}s.txt > count.txt && rm data.csv")
  return _Spec(key=(_csv_text(header, rows), col, "report"),
               prompt=f"From data.csv (it has a header line), write the distinct values of the '{name}' "
               f"column, sorted, one per line, to {name}s.txt; write how many there are (just the number) "
               "to count.txt; "
               "then delete data.csv.", files={"data.csv": _csv_text(header, rows)},
               check={"files": {f"{name}s.txt": "\n".join(distinct) + "\n",
                                "count.txt": f"{len(distinct)}\n"},
                      "absent": ["data.csv"]},
               solve=solve, miss=solve.replace(" && rm data.csv", ""))


def _archive_logs(rng):
  names = _words(rng, rng.randint(3, 5))
  k = rng.randint(2, len(names))
  logs = {f"logs/{n}.log": f"{n} {rng.randint(0, 99)}\n" for n in names[:k]}
  keep = {f"logs/{n}.txt": f"keep {n}\n" for n in names[k:]} | {"logs/README": "log folder\n"}
  listing = "\\n".join(sorted(logs))
  check = f"test \"$(tar -tzf logs.tar.gz | sort)\" = \"$(printf '{listing}')\""
  solve = "tar -czf logs.tar.gz logs/*.log && rm logs/*.log"
  return _Spec(key=tuple(sorted((logs | keep).items())),
               prompt="Put every .log file of the directory logs into a gzip-compressed tar archive "
               "logs.tar.gz (member paths like logs/NAME.log, no other members), then "
               "delete those .log files. Keep the other files in logs.", files=logs | keep,
               check={"files": keep, "absent": sorted(logs), "command": check},
               solve=solve, miss="tar -czf logs.tar.gz logs/*.log")


def _config_edits(rng):
  conf = _config(rng)
  k1, k2, gone = rng.sample(list(conf), 3)
  v1, v2 = conf[k1] + "1" if conf[k1].isdigit() else "on", "off"
  fixed = {k: v for k, v in dict(conf, **{k1: v1, k2: v2}).items() if k != gone}
  solve = f"sed -i -e 's|^{k1}=.*|{k1}={v1}|' -e 's|^{k2}=.*|{k2}={v2}|' -e '/^{gone}=/d' app.conf"
  return _Spec(key=(_conf_text(conf), k1, k2, gone),
               prompt=f"Edit app.conf: set '{k1}' to '{v1}', set '{k2}' to "
               f"'{v2}', and remove the '{gone}' line. Keep every other line exactly as it is.",
               files={"app.conf": _conf_text(conf)}, check={"files": {"app.conf": _conf_text(fixed)}},
               solve=solve, miss=solve.replace(f" -e '/^{gone}=/d'", ""))


_TEMPLATES: dict[int, tuple[Callable[[random.Random], _Spec], ...]] = {
  0: (_create_file, _delete_file, _rename_file, _make_dir),
  1: (_rename_ext, _move_prefix, _count_matches, _sort_lines),
  2: (_csv_column, _sort_unique, _fix_config, _tar_dir),
  3: (_csv_report, _archive_logs, _config_edits),
}


def _draw(rng: random.Random, split: str, difficulty: int) -> tuple[str, _Spec]:
  """A template instance of `split` (rejection sampling on the instance's split hash)."""
  for _ in range(10_000):
    make = rng.choice(_TEMPLATES[difficulty])
    spec = make(rng)
    if common.split_of((DOMAIN, make.__name__, spec["key"])) == split:
      return make.__name__.lstrip("_"), spec
  raise RuntimeError(f"no {split} instance found for terminal level {difficulty}")


def _oracle(spec: _Spec, difficulty: int) -> list[dict[str, Any]]:
  turns = []
  if difficulty >= 2:
    turns.append(common.turn("First I look at what is in the directory.",
                             calls=[("shell", {"command": "ls -R"})]))
  turns.append(common.turn("One command does it: " + spec["solve"],
                           calls=[("shell", {"command": spec["solve"]})]))
  turns.append(common.turn(content="Done."))
  return turns


def generate(*, split: str, difficulty: int, n: int, seed: int) -> list[Task]:
  """`n` terminal tasks of `split` at `difficulty`, deterministic in the arguments."""
  common.check_args(DOMAIN, split, difficulty, MAX_DIFFICULTY, seed, n)
  tasks = []
  for i in range(n):
    rng = common.task_rng(DOMAIN, split, difficulty, seed, i)
    template, spec = _draw(rng, split, difficulty)
    obj = {"id": common.task_id(DOMAIN, split, difficulty, seed, i), "domain": DOMAIN,
           "prompt": spec["prompt"] + " Work in the current directory with the shell tool.",
           "files": spec["files"], "check": spec["check"], "max_turns": 8 + 4 * difficulty,
           "oracle": _oracle(spec, difficulty),
           "meta": common.meta(DOMAIN, split, difficulty, seed, template=template, index=i,
                               near_miss=spec["miss"])}
    tasks.append(parse_task(obj, obj["id"]))
  return tasks


def corrupt_oracle(task: Task) -> list[dict[str, Any]]:
  """The oracle with its solving command replaced by the template's near miss."""
  miss = task.meta["near_miss"]
  return [common.turn("This should do it: " + miss, calls=[("shell", {"command": miss})]),
          common.turn(content="Done.")]
