"""Sandbox limits, task-directory mounts and the file tools, each against a number written out
here (each test names the mistake it catches: a cap kept per stream, a limit off by a factor,
a path check or a size check dropped)."""

import os
from pathlib import Path

import pytest

from rl.envs.base import ToolError
from rl.sandbox import ExecResult, Sandbox, SandboxUnavailable, taskdir
from rl.tools import files
from tests.helpers import isolation_unavailable

MiB = 2 ** 20


# The `small` (nsjail) and `unsafe` sandboxes: tests/rl/conftest.py.


# ---- the sandbox ---------------------------------------------------------------------------


def _both_streams(sandbox, cwd):
  return sandbox.run("head -c 800 /dev/zero | tr '\\0' a; head -c 800 /dev/zero | tr '\\0' b >&2", cwd)


def test_one_output_budget_for_stdout_and_stderr_together(small, unsafe, tmp_path):
  """A budget per stream kept twice the cap (1600 of 1000 bytes) and said nothing was dropped."""
  for sandbox in (small, unsafe):
    result = _both_streams(sandbox, tmp_path)
    assert len(result.stdout) + len(result.stderr) == 1000 and result.truncated, result
    assert set(result.stdout) <= {"a"} and set(result.stderr) <= {"b"}


@pytest.mark.parametrize("which", ["small", "unsafe"])
def test_the_file_size_limit_stops_a_write_at_its_size(which, request, tmp_path):
  sandbox = request.getfixturevalue(which)
  result = sandbox.run("head -c 3M /dev/zero > big; exit $?", tmp_path)
  assert result.exit_code == 128 + 25 and result.killed_reason == "file size limit of 1 MB (SIGXFSZ)", result
  assert (tmp_path / "big").stat().st_size == MiB


def test_the_private_tmp_holds_tmp_mb(small, tmp_path):
  result = small.run("head -c 900K /dev/zero > /tmp/a && echo fits; head -c 300K /dev/zero > /tmp/b",
                     tmp_path)
  assert result.stdout == "fits\n" and "No space left on device" in result.stderr, result


def test_exit_code_255_is_the_commands_own(small, tmp_path):
  result = small.run("echo bye; exit 255", tmp_path)
  assert (result.exit_code, result.stdout, result.killed_reason) == (255, "bye\n", None)


def test_nsjail_failing_to_start_is_raised_with_its_words(tmp_path):
  try:
    broken = Sandbox(memory_mb=128, max_pids=32, timeout_s=5.0)
  except SandboxUnavailable as e:
    isolation_unavailable(f"nsjail cannot run here: {e}")
  broken.tmp_mb = -1  # an impossible /tmp mount: nsjail exits 255 before the command starts
  with pytest.raises(SandboxUnavailable, match=r"nsjail failed to start the command: .*\[[EF]\]"):
    broken.run("echo never", tmp_path)


def test_a_command_killed_by_a_signal_reports_128_plus_it(unsafe, tmp_path):
  result = unsafe.run("kill -9 $$", tmp_path)
  assert result.exit_code == 137 and result.killed_reason.startswith("killed (SIGKILL)"), result


def test_the_deadline_is_the_timeout_not_later(small, unsafe, tmp_path):
  """nsjail's own limit (the timeout rounded up, plus 1 s) only backs ours up: a command ends
  at its timeout, well before that backup (at 1 s: the backup and a deadline of twice the timeout
  both end it at 2 s; 0.9 s of slack for a loaded machine)."""
  for sandbox in (small, unsafe):
    result = sandbox.run("sleep 30", tmp_path, timeout_s=1.0)
    assert result.timed_out and result.killed_reason == "time limit: killed after 1 s of wall time"
    assert 1.0 <= result.wall_s < 1.9, result


@pytest.mark.parametrize("timeout_s", [0, 0.0, float("inf"), float("nan")])
def test_a_timeout_must_be_finite_and_positive(timeout_s):
  with pytest.raises(ValueError, match="must be a finite number of seconds > 0"):
    Sandbox(nsjail="/nonexistent/nsjail", allow_unsafe=True, timeout_s=timeout_s)


# ---- task directories ----------------------------------------------------------------------


def test_inode_cap_is_64_per_mib_and_at_least_4096():
  assert [taskdir.inode_cap(mb) for mb in (1, 4, 63, 64, 100, 256)] == [4096, 4096, 4096, 4096, 6400, 16384]


def test_a_task_tmpfs_has_its_size_mode_and_mount_flags(tmp_path):
  path = tmp_path / "mnt"
  path.mkdir()
  why_not = taskdir.mount_tmpfs(path, 3)
  if why_not is not None:
    isolation_unavailable(why_not)
  try:
    vfs = os.statvfs(path)
    assert vfs.f_blocks * vfs.f_frsize == 3 * MiB and vfs.f_files == 4096
    assert os.stat(path).st_mode & 0o7777 == 0o700
    options = [line.split()[5] for line in Path("/proc/self/mountinfo").read_text().splitlines()
               if line.split()[4] == str(path)]
    assert len(options) == 1 and {"nosuid", "nodev"} <= set(options[0].split(",")), options
  finally:
    taskdir.unmount(path)


def test_remove_tree_when_a_directory_is_named_like_its_scratch_names(tmp_path):
  root = tmp_path / "t"
  for rel in (".rm0/x/y", ".rm1/z", "a/b/c", "a/d"):
    (root / rel).mkdir(parents=True)
    (root / rel / "f").write_text(rel)
  taskdir.remove_tree(root)
  assert not root.exists()


# ---- the file tools ------------------------------------------------------------------------


@pytest.mark.parametrize("path,message", [
  ("..", "through '..'"), ("a/../..", "through '..'"), ("/etc/passwd", "absolute path"),
  ("/taskfoo/x", "absolute path"), ("/task/../x", "through '..'"),
])
def test_resolve_names_why_a_path_is_refused(tmp_path, path, message):
  with pytest.raises(ToolError, match=message):
    files.resolve(tmp_path, path)


def test_resolve_maps_the_sandbox_names_onto_the_root(tmp_path):
  root = tmp_path.resolve()
  assert files.resolve(tmp_path, "/task") == root and files.resolve(tmp_path, ".") == root
  assert files.resolve(tmp_path, "/task/a/b.txt") == root / "a" / "b.txt"


def test_read_file_cuts_past_one_mib_with_a_note(tmp_path):
  (tmp_path / "exact").write_bytes(b"a" * MiB)
  assert files.read_text(tmp_path, "exact") == "a" * MiB
  (tmp_path / "over").write_bytes(b"b" * (MiB + 7))
  assert files.read_text(tmp_path, "over") == "b" * MiB + (
    "\n[file longer than 1048576 bytes: cut; use shell with head/tail/sed to read parts]")


def test_write_file_takes_at_most_four_mib(tmp_path):
  assert files.write_text(tmp_path, "ok", "c" * (4 * MiB)) == f"wrote {4 * MiB} bytes to ok"
  with pytest.raises(ToolError, match=f"content is {4 * MiB + 1} bytes; the limit is {4 * MiB}"):
    files.write_text(tmp_path, "no", "c" * (4 * MiB + 1))
  assert not (tmp_path / "no").exists()


def test_write_file_truncates_refuses_directories_and_replaces_links(tmp_path):
  files.write_text(tmp_path, "f.txt", "a long first version\n")
  files.write_text(tmp_path, "f.txt", "x")
  assert (tmp_path / "f.txt").read_text() == "x"
  (tmp_path / "d").mkdir()
  with pytest.raises(ToolError, match="'d' is a directory"):
    files.write_text(tmp_path, "d", "x")
  (tmp_path / "link").symlink_to(tmp_path / "f.txt")
  files.write_text(tmp_path, "link", "new")
  assert not (tmp_path / "link").is_symlink() and (tmp_path / "link").read_text() == "new"
  assert (tmp_path / "f.txt").read_text() == "x"


def test_write_tree_replaces_a_directory_at_a_path(tmp_path):
  (tmp_path / "tests" / "test_a.py" / "deep").mkdir(parents=True)
  (tmp_path / "tests" / "test_a.py" / "deep" / "x").write_text("agent")
  files.write_tree(tmp_path, {"tests/test_a.py": "hidden\n"})
  assert (tmp_path / "tests" / "test_a.py").read_text() == "hidden\n"


def test_format_exec_shows_what_went_wrong():
  killed = ExecResult(exit_code=137, stdout="partial\n", stderr="", timed_out=False, truncated=True,
                      killed_reason="killed (SIGKILL): most likely the 512 MB memory limit", wall_s=0.5)
  assert files.format_exec(killed, 1000) == (
    "exit code: 137\nKILLED: killed (SIGKILL): most likely the 512 MB memory limit\nstdout:\npartial\n"
    "[output past 1000 bytes was dropped; redirect it to a file and read parts]")
  slow = ExecResult(exit_code=137, stdout="", stderr="err\n", timed_out=True, truncated=False,
                    killed_reason="time limit: killed after 2 s of wall time", wall_s=2.0)
  assert files.format_exec(slow, 1000) == (
    "exit code: 137\nTIMEOUT: time limit: killed after 2 s of wall time; make the command faster or run "
    "less at once\nstderr:\nerr")


def test_a_colon_in_the_task_path_is_refused_by_name(small, unsafe, tmp_path, monkeypatch):
  """nsjail's --bindmount SRC:DST cannot name a directory with ':' (every command failed, reported
  as 'nsjail failed to start'); it is refused by name, and the unsafe runner still takes it."""
  import tempfile

  from rl.envs.base import EnvContext

  odd = tmp_path / "a:b"
  odd.mkdir()
  with pytest.raises(ValueError, match=r"sandbox cwd .*a:b' contains ':'"):
    small.run("echo ok", odd)
  assert unsafe.run("echo ok", odd).stdout == "ok\n"
  with pytest.raises(ValueError, match=r"config.env.root=.*a:b/episodes' contains ':'"):
    EnvContext(root=odd / "episodes")
  assert not (odd / "episodes").exists()
  monkeypatch.setattr(tempfile, "tempdir", str(odd))
  with pytest.raises(ValueError, match=r"TMPDIR=.*a:b' contains ':'"):
    EnvContext()
  assert list(odd.iterdir()) == []  # nothing made there
