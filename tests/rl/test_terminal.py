"""Terminal tasks: generation contract, oracle/near-miss grading, and tool error handling."""

import json
import logging
import os
from pathlib import Path

import pytest

from rl.envs.base import EnvContext, make_env
from rl.sandbox import taskdir
from rl.tasks.generators import generate
from rl.tasks.generators import terminal as gen
from rl.tasks.schema import parse_task
from serving.types import ToolCall
from tests.helpers import isolation_unavailable
from tests.rl.replay import replay_scores, sandboxed_context

LEVELS = range(gen.MAX_DIFFICULTY + 1)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
  return sandboxed_context(tmp_path_factory, "terminal", command_timeout_s=10.0)


@pytest.mark.parametrize("level", LEVELS)
def test_schema_round_trip_and_determinism(level):
  tasks = generate("terminal", split="train", difficulty=level, n=20, seed=3)
  for task in tasks:
    assert parse_task(json.loads(json.dumps(task.to_json()))) == task
  again = generate("terminal", split="train", difficulty=level, n=20, seed=3)
  assert [t.to_json() for t in again] == [t.to_json() for t in tasks]
  other = generate("terminal", split="train", difficulty=level, n=20, seed=4)
  assert [t.to_json() for t in other] != [t.to_json() for t in tasks]


@pytest.mark.parametrize("level", LEVELS)
def test_splits_share_no_instance(level):
  def instances(split):
    return {json.dumps([t.meta["template"], t["files"], t["check"]], sort_keys=True)
            for t in generate("terminal", split=split, difficulty=level, n=150, seed=0)}
  assert not instances("train") & instances("heldout")


def test_an_instance_drawn_in_another_order_keeps_its_split():
  # The split key once followed the order the file names were drawn in: the same three files
  # with the same one to delete had six keys, and 82% of such instances could be drawn in both
  # splits (7 of 770 held-out delete_file tasks below were train tasks too).
  def instances(split, level):
    return {json.dumps([t.meta["template"], t.prompt, t["files"], t["check"]], sort_keys=True)
            for t in generate("terminal", split=split, difficulty=level, n=3000, seed=0)}
  for level in (0, 1):
    assert not instances("train", level) & instances("heldout", level), level


@pytest.mark.parametrize("level", LEVELS)
def test_oracle_scores_1_and_near_miss_0(level, ctx):
  oracle, corrupt = replay_scores("terminal", level, ctx, n_train=2, n_heldout=1, seed=0)
  assert oracle == [1.0] * 3
  assert corrupt == [0.0] * 3


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_oracle_and_near_miss_200_per_level(level, ctx):
  oracle, corrupt = replay_scores("terminal", level, ctx, n_train=100, n_heldout=100, seed=11)
  print(f"terminal level {level}: oracle {sum(oracle):.0f}/200, near miss 0 on {corrupt.count(0.0)}/200")
  assert oracle == [1.0] * 200
  assert corrupt == [0.0] * 200


def test_tool_errors_come_back_as_results(ctx):
  fast = EnvContext(root=ctx.root, command_timeout_s=1.0)
  task = generate("terminal", split="train", difficulty=1, n=1, seed=0)[0]
  env = make_env(task, fast)
  try:
    env.reset()

    def call(name, arguments):
      raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
      return env.execute(ToolCall(id="c", name=name, arguments=raw))

    assert call("browse", {}).error
    assert "not valid JSON" in call("shell", "{not json").content
    assert call("shell", {"cmd": "ls"}).error  # schema violation
    for bad in ("/etc/passwd", "../outside.txt", "a/../../x"):
      result = call("read_file", {"path": bad})
      assert result.error and "task directory" in result.content, result
    assert not call("shell", {"command": "ln -s /etc escape && ln -s / root_link"}).error
    for bad in ("escape/passwd", "root_link/etc/hostname"):
      assert call("read_file", {"path": bad}).error
      assert call("write_file", {"path": bad, "content": "x"}).error
    slow = call("shell", {"command": "sleep 5"})
    assert slow.error and "TIMEOUT" in slow.content
    failing = call("shell", {"command": "echo out; exit 2"})  # a failing command is not a tool error
    assert not failing.error and "exit code: 2" in failing.content
    assert not call("write_file", {"path": "sub/dir/new.txt", "content": "hi\n"}).error
    assert call("read_file", {"path": "sub/dir/new.txt"}).content == "hi\n"
    assert "hi" in call("shell", {"command": "cat sub/dir/new.txt"}).content
    assert call("read_file", {"path": "sub"}).error
    assert call("read_file", {"path": "missing.txt"}).error
    # A FIFO blocked the host thread forever on open (reading or writing it).
    assert not call("shell", {"command": "mkfifo pipe"}).error
    fifo = call("read_file", {"path": "pipe"})
    assert fifo.error and "not a regular file" in fifo.content
    assert not call("write_file", {"path": "pipe", "content": "now a file\n"}).error
    assert call("read_file", {"path": "pipe"}).content == "now a file\n"
    # A file where a parent directory should be is named, not an internal failure.
    parent = call("write_file", {"path": "sub/dir/new.txt/x", "content": "x"})
    assert parent.error and "'sub/dir/new.txt' is a file, not a directory" in parent.content
    deep = call("shell", "[" * 100_000)  # the OpenAI client passes a server's arguments through
    assert deep.error and "nested too deeply" in deep.content
  finally:
    env.close()


def _capped_env(root, disk_mb: int):
  """A reset terminal episode whose task directory is a tmpfs of disk_mb (skips where none mounts)."""
  env = make_env(generate("terminal", split="train", difficulty=0, n=1, seed=0)[0],
                 EnvContext(root=root, disk_mb=disk_mb))
  if str(env.dir) not in _mount_points():
    env.close()
    isolation_unavailable("this process cannot mount a tmpfs (needs root on Linux); task directories are "
                          "uncapped")
  env.reset()
  return env


def test_a_command_cannot_fill_the_disk_past_the_task_directory_cap(tmp_path):
  """--rlimit_fsize caps one file; five 60 MB files in one command wrote 301 MB to the host's disk."""
  env = _capped_env(tmp_path, 16)
  try:
    fill = env.execute(ToolCall(id="c", name="shell", arguments=json.dumps(
      {"command": "for i in 1 2 3; do head -c 8M /dev/zero > f$i; done; du -sm . | cut -f1"})))
    assert "No space left on device" in fill.content, fill.content
    assert sum(f.stat().st_size for f in env.dir.iterdir()) <= 16 * 2 ** 20
    big = env.execute(ToolCall(id="c", name="write_file",
                               arguments=json.dumps({"path": "g", "content": "x" * 2 ** 20})))
    assert big.error and "the task directory is full" in big.content, big.content
    path = env.dir
  finally:
    env.close()
  assert not path.exists() and str(path) not in _mount_points()


def _shell(env, command):
  return env.execute(ToolCall(id="c", name="shell", arguments=json.dumps({"command": command})))


def test_empty_files_stop_at_the_inode_cap(tmp_path):
  """A tmpfs without nr_inodes had ~3M inodes: 1.1M empty files (8K used) grew the host's kernel
  memory by more than 1 GB. Now files past the inode cap fail with ENOSPC while the data is tiny."""
  cap = taskdir.inode_cap(4)
  env = _capped_env(tmp_path, 4)
  try:
    assert os.statvfs(env.dir).f_files == cap
    fill = _shell(env, f"touch e{{1..{cap + 2000}}} 2>&1 | tail -n 1")
    assert "No space left on device" in fill.content, fill.content
    assert cap - 10 < len(os.listdir(env.dir)) < cap
    vfs = os.statvfs(env.dir)
    assert (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize < 2 ** 20  # the data is tiny
    full = env.execute(ToolCall(id="c", name="write_file",
                                arguments=json.dumps({"path": "n", "content": "x"})))
    assert full.error and "the task directory is full" in full.content, full.content
    assert "exit code: 0" in _shell(env, "rm -f e*; echo x > n").content  # and usable again
  finally:
    env.close()


def test_a_deep_tree_breaks_neither_the_episode_nor_its_close(ctx, tmp_path, monkeypatch):
  """1100 nested directories made every later shell call fail with RecursionError, and in an
  uncapped task directory (no tmpfs) env.close() raised RecursionError out of
  shutil.rmtree(ignore_errors=True), which failed the whole run."""
  monkeypatch.setattr(taskdir, "mount_tmpfs", lambda path, size_mb: "simulated: mount refused")
  uncapped = EnvContext(root=tmp_path, command_timeout_s=10.0)
  task = generate("terminal", split="train", difficulty=0, n=1, seed=0)[0]
  env = make_env(task, uncapped)
  path = env.dir
  try:
    env.reset()
    deep = _shell(env, "python3 -c 'import os\nfor _ in range(1100):\n  os.mkdir(\"directory_\"); "
                       "os.chdir(\"directory_\")'")  # 12 kB of path: past PATH_MAX too
    assert "exit code: 0" in deep.content, deep.content
    after = _shell(env, "echo alive")
    assert not after.error and "alive" in after.content, after.content
  finally:
    env.close()
  assert not path.exists()


def test_closing_an_episode_never_raises(tmp_path, monkeypatch, caplog):
  """A failure to remove a task directory is logged; close() must not end the run."""
  ctx = EnvContext(root=tmp_path)
  path = ctx.new_dir("t")

  def broken(p):
    raise RecursionError("maximum recursion depth exceeded")

  monkeypatch.setattr(taskdir, "remove_tree", broken)
  with caplog.at_level(logging.WARNING):
    ctx.remove_dir(path)
  assert "cannot remove" in caplog.text and "RecursionError" in caplog.text
  monkeypatch.undo()
  ctx.remove_dir(path)
  assert not path.exists()


def test_a_nul_byte_in_a_command_is_a_clean_error(ctx, caplog):
  """subprocess raised ValueError (embedded null byte), logged as a tool crash with a traceback."""
  env = make_env(generate("terminal", split="train", difficulty=0, n=1, seed=0)[0], ctx)
  try:
    env.reset()
    with caplog.at_level(logging.WARNING):
      result = _shell(env, "echo a\x00b")
    assert result.error and "NUL byte" in result.content and "internally" not in result.content, result
    assert "crashed" not in caplog.text
    assert not _shell(env, "echo fine").error
  finally:
    env.close()


def _mount_points() -> set[str]:
  return {line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()}


_KILLED_CHILD = """
import os, signal, sys
from pathlib import Path
from rl.envs.base import EnvContext
own = EnvContext(disk_mb=4)  # its own root under the temp directory
shared = EnvContext(root=Path(sys.argv[1]), disk_mb=4)
for ctx in (own, shared):
  (ctx.new_dir("t 1") / "f").write_bytes(b"x" * 1000)
print(own.root, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # as an OOM kill or a preemption: nothing is unmounted
"""


def test_mounts_of_a_killed_process_are_swept(tmp_path):
  """A process killed with SIGKILL left its tmpfs task directories mounted (their files held in
  memory until reboot); the next EnvContext unmounts and removes those of dead processes only."""
  import subprocess
  import sys
  shared = tmp_path / "shared"
  alive = EnvContext(root=shared, disk_mb=4)
  mine = alive.new_dir("mine")
  if str(mine) not in _mount_points():
    alive.remove_dir(mine)
    isolation_unavailable("this process cannot mount a tmpfs (needs root on Linux); nothing is left mounted")
  child = subprocess.run([sys.executable, "-c", _KILLED_CHILD, str(shared)], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[2])
  assert child.returncode == -9, child.stderr
  own_root = Path(child.stdout.strip())
  left = [m for m in _mount_points() if m.startswith((str(own_root), str(shared)))]
  assert len(left) == 3 and str(mine) in left  # the child's two and ours
  EnvContext(root=shared, disk_mb=4)
  assert [m for m in _mount_points() if m.startswith((str(own_root), str(shared)))] == [str(mine)]
  assert not own_root.exists() and [p.name for p in shared.iterdir()] == [mine.name]
  alive.remove_dir(mine)
