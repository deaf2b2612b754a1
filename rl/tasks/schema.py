"""The task schema: one JSON object per task (JSONL files of them: rl/tasks/task_files.py).

This format is a public interface: task files written elsewhere in it run unchanged. Every
task has

  id        unique non-empty string
  domain    math | code | terminal | web | docqa | cad
  prompt    the user's request (string); the first user message is exactly `prompt`
            (docqa: `document`, a blank line, then `prompt`)
  max_turns optional int >= 1: the most assistant messages of an episode
  tier      optional low | high | max: the thinking budget tier

and per domain:

  math      answer: str or number
  code      files {relative path: content}, test_command: str (bash -c in the repository
            root; reward 1 iff it exits 0), hidden_files {path: content} (copied in over the
            agent's work at grading only; optional, default {}), timeout: optional seconds
            (default 120), pass_marker: optional string that only the hidden files hold and
            the hidden tests print when all of them pass; given, reward 1 also needs it in
            the command's stdout (its first 64 KiB), so ending the process early with exit
            code 0 (`os._exit(0)` on import) does not pass
  terminal  files {path: content} (the initial working directory), check: {files: {path:
            exact content}, absent: [paths], command: shell command that must exit 0}, at
            least one of the three
  web       answer: str or number, and exactly one of pages [{url, title, text}] (an offline
            site shipped in the task) or corpus (the name of a built-in corpus)
  docqa     document: str (markdown, may be long), answer: str or number, tolerance:
            optional relative tolerance >= 0 (default 1e-3; absolute when the answer is 0)
  cad       target: a solid of the grammar in `validate_solid`

Two optional fields are Horizon extensions that other writers may leave out: `oracle`, a
trajectory that solves the task (a list of assistant turns {thinking, content, tool_calls:
[{name, arguments}], optional thinking_by_tier: {low|high|max: thinking} where the depth of
thinking should follow the tier's budget}; the generators write it, SFT trains on it, tests
replay it), and
`meta`, a free object (generator, difficulty, split, seed) that nothing grades.

Unknown fields are an error (a typo like `anwser` must not silently make a task ungradable).
Errors name the file, the line, the field and what was expected (`TaskError`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import posixpath
from collections.abc import Iterable, Mapping
from typing import Any

DOMAINS = ("math", "code", "terminal", "web", "docqa", "cad")
TIERS = ("low", "high", "max")
# Built-in web corpora (rl/tools/corpora.py builds them from text every machine has).
CORPORA = ("python-docs",)
DEFAULT_CODE_TIMEOUT_S = 120.0
DEFAULT_DOCQA_TOLERANCE = 1e-3
SOLID_OPS = ("union", "difference", "intersection")
SOLID_PRIMITIVES = ("box", "cylinder", "sphere")
# Lengths and positions of the CAD grammar: wide enough for any part (targets use 1-50), narrow
# enough that a volume stays a finite float64 (a box of 1e200 measured NaN) and that manifold3d's
# tolerance (relative to a mesh's extent) still resolves the smallest length at the largest reach.
SOLID_MIN_LENGTH, SOLID_MAX_LENGTH = 1e-3, 1e4

_COMMON = ("id", "domain", "prompt", "max_turns", "tier", "oracle", "meta")
_DOMAIN_FIELDS = {
  "math": ("answer",),
  "code": ("files", "test_command", "hidden_files", "timeout", "pass_marker"),
  "terminal": ("files", "check"),
  "web": ("answer", "pages", "corpus"),
  "docqa": ("document", "answer", "tolerance"),
  "cad": ("target",),
}


class TaskError(ValueError):
  """A task that does not follow the schema. `where` is 'file:line' (or 'task[i]')."""

  def __init__(self, where: str, field: str | None, message: str):
    self.where, self.field = where, field
    at = f" field '{field}'" if field else ""
    super().__init__(f"{where}:{at} {message}")


@dataclasses.dataclass(frozen=True)
class Task:
  """One validated task. `fields` holds the domain's own fields (defaults filled in)."""

  id: str
  domain: str
  prompt: str
  fields: Mapping[str, Any]
  max_turns: int | None = None
  tier: str | None = None
  oracle: tuple[Mapping[str, Any], ...] | None = None
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __getitem__(self, name: str) -> Any:
    return self.fields[name]

  def first_user_message(self) -> str:
    """The first user message, exactly as the conventions fix it."""
    if self.domain == "docqa":
      return f"{self.fields['document']}\n\n{self.prompt}"
    return self.prompt

  def to_json(self) -> dict[str, Any]:
    """The task as a JSON object (round-trips through `parse_task`)."""
    out: dict[str, Any] = {"id": self.id, "domain": self.domain, "prompt": self.prompt}
    if self.max_turns is not None:
      out["max_turns"] = self.max_turns
    if self.tier is not None:
      out["tier"] = self.tier
    out.update({k: v for k, v in self.fields.items() if v is not None})
    if self.oracle is not None:
      out["oracle"] = [dict(t) for t in self.oracle]
    if self.meta:
      out["meta"] = dict(self.meta)
    return out

  def with_(self, **changes) -> "Task":
    return dataclasses.replace(self, **changes)


# ---- field checks -------------------------------------------------------------------------


_TYPE_NAMES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number"}


def _type_name(v: Any) -> str:
  return "null" if v is None else _TYPE_NAMES.get(type(v), type(v).__name__)


def _need(cond: bool, where: str, field: str, expected: str, got: Any) -> None:
  if not cond:
    raise TaskError(where, field, f"expected {expected}, got {_type_name(got)} {_short(got)}")


def _short(v: Any) -> str:
  text = json.dumps(v, default=str) if not isinstance(v, str) else repr(v)
  return text if len(text) <= 60 else text[:57] + "..."


def _is_number(v: Any) -> bool:
  try:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
  except OverflowError:  # an integer past float's range (a JSON 1 followed by 400 zeros)
    return False


def _is_length(v: Any) -> bool:
  return _is_number(v) and SOLID_MIN_LENGTH <= v <= SOLID_MAX_LENGTH


def _string(obj: Mapping, key: str, where: str, *, nonempty: bool = False, command: bool = False) -> str:
  v = obj[key]
  _need(isinstance(v, str) and (bool(v.strip()) or not nonempty), where, key,
        "a non-empty string" if nonempty else "a string", v)
  _encodable(v, where, key)
  if command and "\x00" in v:
    raise TaskError(where, key, "contains a NUL byte, which no shell command line can hold; remove it")
  return v


def _encodable(v: Any, where: str, field: str) -> None:
  """Refuses a string (or a JSON value holding one) that cannot be written as UTF-8 (a lone surrogate
  from a JSON `\\ud800` escape): it would pass here and fail when the task is set up, written out or
  tokenized."""
  text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=str)
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    at = f" at character {e.start}" if isinstance(v, str) else ""
    raise TaskError(where, field, f"holds {text[e.start:e.end]!r}{at}, which is not valid "
                    "Unicode text (a lone surrogate); write the character itself or drop it") from None


def _answer(obj: Mapping, where: str) -> str | int | float:
  v = obj["answer"]
  _need((isinstance(v, str) and bool(v.strip())) or _is_number(v), where, "answer",
        "a non-empty string or a finite number", v)
  if isinstance(v, str):
    _encodable(v, where, "answer")
  return v


def check_relative_path(path: Any, where: str, field: str) -> str:
  """A path inside the task directory: relative, normalised, no '..', no empty name."""
  _need(isinstance(path, str) and bool(path), where, field, "a non-empty path string", path)
  _encodable(path, where, field)
  norm = posixpath.normpath(path)
  if path.startswith("/") or norm == "." or (norm + "/").startswith("../") or "\\" in path or "\x00" in path:
    raise TaskError(
      where,
      field,
      f"path {path!r} must be relative to the task directory (no leading "
      "'/', no '..', no backslash), e.g. 'src/main.py'",
    )
  return norm


def _files(obj: Mapping, key: str, where: str, *, required: bool = True) -> dict[str, str]:
  if key not in obj:
    if required:
      raise TaskError(where, key, "is required: an object {relative path: file content}")
    return {}
  v = obj[key]
  _need(isinstance(v, dict), where, key, "an object {relative path: file content}", v)
  out, given = {}, {}
  for path, content in v.items():
    norm = check_relative_path(path, where, f"{key}")
    _need(isinstance(content, str), where, f"{key}[{path!r}]", "file content as a string", content)
    _encodable(content, where, f"{key}[{path!r}]")
    if norm in out:
      raise TaskError(where, f"{key}[{path!r}]", f"is the same file as {given[norm]!r} ({norm!r}); "
                      "give each file once")
    out[norm], given[norm] = content, path
  for norm, path in given.items():  # written out, the file would replace the directory or vice versa
    inside = [norm[:i] for i, c in enumerate(norm) if c == "/" and norm[:i] in out]
    if inside:
      raise TaskError(where, f"{key}[{path!r}]", f"lies inside {given[inside[0]]!r}, which is a file; a path "
                      "is a file or a directory, not both")
  return out


def _positive_int(v: Any, where: str, field: str) -> int:
  _need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, where, field, "an integer >= 1", v)
  return v


def validate_solid(node: Any, where: str, field: str = "target", depth: int = 0) -> None:
  """The CAD grammar: primitives centred on the origin, optionally moved by `at`.

  {"box": [sx, sy, sz]} full edge lengths > 0; {"cylinder": [radius, height]} along z;
  {"sphere": radius}; {"union" | "difference" | "intersection": [solid, ...]} (difference =
  the first minus all the others); any node may carry "at": [x, y, z].
  """
  if depth > 32:
    raise TaskError(where, field, "solid nests deeper than 32 levels")
  _need(isinstance(node, dict), where, field, 'a solid object such as {"box": [1, 2, 3]}', node)
  kinds = [k for k in node if k != "at"]
  extra = [k for k in kinds if k not in SOLID_PRIMITIVES + SOLID_OPS]
  if extra or len(kinds) != 1:
    raise TaskError(
      where,
      field,
      f"a solid has exactly one of {', '.join(SOLID_PRIMITIVES + SOLID_OPS)}"
      f" (plus optional 'at'); got keys {sorted(node)}",
    )
  kind = kinds[0]
  arg = node[kind]
  sub = f"{field}.{kind}"
  span = f"in [{SOLID_MIN_LENGTH:g}, {SOLID_MAX_LENGTH:g}]"
  if "at" in node:
    at = node["at"]
    _need(
      isinstance(at, list) and len(at) == 3 and all(_is_number(a) and abs(a) <= SOLID_MAX_LENGTH for a in at),
      where,
      f"{field}.at",
      f"[x, y, z] of 3 numbers in [-{SOLID_MAX_LENGTH:g}, {SOLID_MAX_LENGTH:g}]",
      at,
    )
  if kind == "box":
    _need(isinstance(arg, list) and len(arg) == 3 and all(map(_is_length, arg)), where, sub,
          f"[sx, sy, sz]: 3 edge lengths {span}", arg)
  elif kind == "cylinder":
    _need(isinstance(arg, list) and len(arg) == 2 and all(map(_is_length, arg)), where, sub,
          f"[radius, height], both {span}", arg)
  elif kind == "sphere":
    _need(_is_length(arg), where, sub, f"a radius {span} (a number)", arg)
  else:
    _need(isinstance(arg, list) and len(arg) >= 1, where, sub, "a non-empty list of solids", arg)
    for i, child in enumerate(arg):
      validate_solid(child, where, f"{sub}[{i}]", depth + 1)


def _check(obj: Mapping, where: str) -> None:
  terminal_check = obj["check"]
  _need(
    isinstance(terminal_check, dict), where, "check", "an object {files, absent, command}", terminal_check
  )
  unknown = set(terminal_check) - {"files", "absent", "command"}
  if unknown:
    raise TaskError(where, "check", f"unknown key(s) {sorted(unknown)}; allowed: files, absent, command")
  if not terminal_check:
    raise TaskError(where, "check", "needs at least one of files, absent, command (else it always passes)")
  files = _files(terminal_check, "files", where, required=False)
  absent = terminal_check.get("absent", [])
  _need(isinstance(absent, list), where, "check.absent", "a list of paths", absent)
  for p in absent:
    norm = check_relative_path(p, where, "check.absent")
    needed = [f for f in files if f == norm or f.startswith(norm + "/")]
    if needed:  # the check could never pass: every episode of the task would score 0
      raise TaskError(where, "check.absent", f"{p!r} must be absent, but check.files needs {needed[0]!r}")
  if "command" in terminal_check:
    _string(terminal_check, "command", where, nonempty=True, command=True)


def _pages(obj: Mapping, where: str) -> list[dict[str, str]]:
  pages = obj["pages"]
  _need(
    isinstance(pages, list) and bool(pages), where, "pages", "a non-empty list of {url, title, text}", pages
  )
  seen = set()
  for i, page in enumerate(pages):
    _need(
      isinstance(page, dict) and set(page) == {"url", "title", "text"},
      where,
      f"pages[{i}]",
      "an object with exactly the keys url, title, text",
      page,
    )
    for key in ("url", "title", "text"):
      _need(isinstance(page[key], str), where, f"pages[{i}].{key}", "a string", page[key])
    if page["url"] in seen:
      raise TaskError(where, f"pages[{i}].url", f"duplicate url {page['url']!r}")
    seen.add(page["url"])
  return [dict(p) for p in pages]


def _domain_fields(obj: Mapping, domain: str, where: str) -> dict[str, Any]:
  for key in _DOMAIN_FIELDS[domain]:
    optional = key in ("hidden_files", "timeout", "tolerance", "pages", "corpus", "pass_marker")
    if key not in obj and not optional:
      raise TaskError(where, key, f"is required for domain {domain!r}")
  if domain == "math":
    return {"answer": _answer(obj, where)}
  if domain == "code":
    timeout = obj.get("timeout", DEFAULT_CODE_TIMEOUT_S)
    _need(_is_number(timeout) and timeout > 0, where, "timeout", "seconds > 0", timeout)
    out = {
      "files": _files(obj, "files", where),
      "test_command": _string(obj, "test_command", where, nonempty=True, command=True),
      "hidden_files": _files(obj, "hidden_files", where, required=False),
      "timeout": float(timeout),
      "pass_marker": None,
    }
    if "pass_marker" in obj:
      out["pass_marker"] = _pass_marker(obj, out, where)
    return out
  if domain == "terminal":
    _check(obj, where)
    check = dict(obj["check"])
    check["files"] = _files(check, "files", where, required=False)
    check["absent"] = [posixpath.normpath(p) for p in check.get("absent", [])]
    return {"files": _files(obj, "files", where), "check": check}
  if domain == "web":
    if ("pages" in obj) == ("corpus" in obj):
      raise TaskError(
        where,
        "pages",
        f"a web task has exactly one of 'pages' (an offline site) or 'corpus' (one of {', '.join(CORPORA)})",
      )
    out: dict[str, Any] = {"answer": _answer(obj, where)}
    if "pages" in obj:
      out["pages"] = _pages(obj, where)
    else:
      corpus = _string(obj, "corpus", where, nonempty=True)
      if corpus not in CORPORA:
        raise TaskError(where, "corpus", f"unknown corpus {corpus!r}; built-in corpora: {', '.join(CORPORA)}")
      out["corpus"] = corpus
    return out
  if domain == "docqa":
    tol = obj.get("tolerance", DEFAULT_DOCQA_TOLERANCE)
    _need(_is_number(tol) and tol >= 0, where, "tolerance", "a relative tolerance >= 0", tol)
    return {
      "document": _string(obj, "document", where, nonempty=True),
      "answer": _answer(obj, where),
      "tolerance": float(tol),
    }
  validate_solid(obj["target"], where)
  return {"target": obj["target"]}


def _pass_marker(obj: Mapping, code: Mapping[str, Any], where: str) -> str:
  """A marker the hidden tests print, unseen by the agent (else it proves nothing)."""
  marker = _string(obj, "pass_marker", where, nonempty=True)
  if not any(marker in text for text in code["hidden_files"].values()):
    raise TaskError(where, "pass_marker", "appears in no hidden file; the hidden tests must print it when "
                    "they all pass (else no solution can pass)")
  seen = ["prompt"] if marker in obj["prompt"] else []
  seen += [p for p, text in code["files"].items() if marker in text]
  if seen:
    raise TaskError(where, "pass_marker", f"appears in {seen[0]!r}, which the agent can read and print; "
                    "keep it in the hidden files only")
  return marker


def _oracle(v: Any, where: str) -> tuple[dict[str, Any], ...]:
  _need(isinstance(v, list) and bool(v), where, "oracle", "a non-empty list of assistant turns", v)
  turns = []
  for i, turn in enumerate(v):
    f = f"oracle[{i}]"
    _need(
      isinstance(turn, dict) and set(turn) <= {"thinking", "content", "tool_calls", "thinking_by_tier"},
      where,
      f,
      "an object with keys among thinking, content, tool_calls, thinking_by_tier",
      turn,
    )
    for key in ("thinking", "content"):
      _need(isinstance(turn.get(key, ""), str), where, f"{f}.{key}", "a string", turn.get(key))
    by_tier = turn.get("thinking_by_tier", {})
    _need(
      isinstance(by_tier, dict)
      and set(by_tier) <= {"low", "high", "max"}
      and all(isinstance(t, str) for t in by_tier.values()),
      where,
      f"{f}.thinking_by_tier",
      "an object {low|high|max: thinking string} (the thinking to write at that tier)",
      by_tier,
    )
    calls = turn.get("tool_calls", [])
    _need(isinstance(calls, list), where, f"{f}.tool_calls", "a list of {name, arguments}", calls)
    for j, call in enumerate(calls):
      _need(
        isinstance(call, dict)
        and set(call) == {"name", "arguments"}
        and isinstance(call["name"], str)
        and isinstance(call["arguments"], dict),
        where,
        f"{f}.tool_calls[{j}]",
        "an object {name: str, arguments: object}",
        call,
      )
    if i < len(v) - 1 and not calls:
      raise TaskError(
        where,
        f,
        "only the last oracle turn may be without tool calls (a turn without calls ends the episode)",
      )
    turns.append(
      {
        "thinking": turn.get("thinking", ""),
        "content": turn.get("content", ""),
        "tool_calls": [dict(c) for c in calls],
        **({"thinking_by_tier": dict(by_tier)} if by_tier else {}),
      }
    )
  return tuple(turns)


def parse_task(obj: Any, where: str = "task") -> Task:
  """Validates one task object; raises TaskError naming `where`, the field and the fix."""
  _need(isinstance(obj, dict), where, None, "a JSON object per task", obj)
  for key in ("id", "domain", "prompt"):
    if key not in obj:
      raise TaskError(where, key, "is required (every task has id, domain, prompt)")
  task_id = _string(obj, "id", where, nonempty=True)
  domain = obj["domain"]
  if domain not in DOMAINS:
    raise TaskError(where, "domain", f"must be one of {', '.join(DOMAINS)}; got {_short(domain)}")
  unknown = set(obj) - set(_COMMON) - set(_DOMAIN_FIELDS[domain])
  if unknown:
    raise TaskError(
      where,
      sorted(unknown)[0],
      f"is not a field of a {domain} task; known fields: {', '.join(_COMMON + _DOMAIN_FIELDS[domain])}",
    )
  prompt = _string(obj, "prompt", where, nonempty=True)
  max_turns = _positive_int(obj["max_turns"], where, "max_turns") if "max_turns" in obj else None
  tier = obj.get("tier")
  if tier is not None and tier not in TIERS:
    raise TaskError(where, "tier", f"must be one of {', '.join(TIERS)}; got {_short(tier)}")
  meta = obj.get("meta", {})
  _need(isinstance(meta, dict), where, "meta", "an object", meta)
  for key in ("oracle", "meta", "pages"):  # strings inside them: valid Unicode
    if key in obj:
      _encodable(obj[key], where, key)
  oracle = _oracle(obj["oracle"], where) if "oracle" in obj else None
  return Task(
    id=task_id,
    domain=domain,
    prompt=prompt,
    fields=_domain_fields(obj, domain, where),
    max_turns=max_turns,
    tier=tier,
    oracle=oracle,
    meta=dict(meta),
  )


def parse_tasks(objs: Iterable[Any], where: str = "tasks") -> list[Task]:
  """Validates many task objects (ids must be unique)."""
  tasks, seen = [], {}
  for i, obj in enumerate(objs):
    task = parse_task(obj, f"{where}[{i}]")
    if task.id in seen:
      raise TaskError(f"{where}[{i}]", "id", f"duplicate id {task.id!r} (first at {seen[task.id]})")
    seen[task.id] = f"{where}[{i}]"
    tasks.append(task)
  return tasks
