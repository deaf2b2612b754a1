"""What a sandboxed command's process does to its result, in both back ends: signals it sends
itself, threads against the CPU limit, pipes it closes, jobs it leaves behind; and the inputs
the sandbox refuses (a per-call timeout, a TMPDIR nsjail cannot mount, a binary that is not
nsjail, a tmpfs of no size, a lone surrogate in a tool call). Each test names the mistake."""

import os
import tempfile
import time

import pytest

from model.config import ConfigError
from rl.envs.base import EnvContext, ToolError
from rl.sandbox import Sandbox, SandboxUnavailable, taskdir
from rl.sandbox.capture import run_capped
from rl.tools import files

# The `small` (nsjail) and `unsafe` sandboxes: tests/rl/conftest.py.


@pytest.mark.parametrize("which", ["small", "unsafe"])
def test_a_command_that_signals_itself_ends_as_the_signal_says(which, request, tmp_path):
  """Under nsjail the command was the jail's PID 1, and the kernel drops the signals PID 1 sends
  itself without a handler: `kill -9 $$` went on to exit 0, abort() came back as 139."""
  sandbox = request.getfixturevalue(which)
  killed = sandbox.run("kill -9 $$; echo survived", tmp_path)
  assert killed.exit_code == 137 and "survived" not in killed.stdout, killed
  term = sandbox.run("kill -TERM $$; echo survived", tmp_path)
  assert term.exit_code == 143 and "survived" not in term.stdout, term
  aborted = sandbox.run("python3 -c 'import os; os.abort()'", tmp_path)
  assert aborted.exit_code == 134, aborted
  assert sandbox.run("exit 3", tmp_path).exit_code == 3


@pytest.mark.parametrize("which", ["small", "unsafe"])
def test_the_cpu_limit_leaves_room_for_every_core_until_the_deadline(which, request, tmp_path):
  """RLIMIT_CPU was the wall timeout + 1 s, counted over all threads: N busy threads were killed
  after ~timeout / N seconds, with SIGKILL, reported as the memory limit."""
  sandbox = request.getfixturevalue(which)
  result = sandbox.run("ulimit -S -t; ulimit -H -t", tmp_path, timeout_s=3)
  soft, hard = (int(x) for x in result.stdout.split())
  assert soft == hard == (3 + 1) * os.cpu_count(), result


def test_the_deadline_holds_after_the_command_closes_its_pipes(unsafe, tmp_path):
  """Once stdout and stderr were closed (`exec >log 2>&1`), the reader returned and waited on the
  process with no deadline: a 30 s sleep ran its 30 s (nsjail's own limit hid it there)."""
  result = unsafe.run("exec >job.log 2>&1; echo working; sleep 30", tmp_path, timeout_s=1.0)
  assert result.timed_out and result.exit_code == 143 and 1.0 <= result.wall_s < 1.9, result
  assert (tmp_path / "job.log").read_text() == "working\n"
  start = time.monotonic()
  cap = run_capped(["/bin/sh", "-c", "exec >/dev/null 2>&1; sleep 30"], env={}, cwd=None, timeout_s=1.0,
                   output_limit=10)
  assert cap.deadline_hit and time.monotonic() - start < 1.9, cap


def _running(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def test_nothing_a_command_started_outlives_it(unsafe, tmp_path):
  """A background job with its output redirected held no pipe, so it was never killed: stray
  servers and sleepers piled up across an episode's commands (nsjail's PID namespace ends them)."""
  result = unsafe.run("sleep 300 >/dev/null 2>&1 & echo $!", tmp_path)
  pid = int(result.stdout)
  for _ in range(50):  # SIGKILL is sent before run() returns; reaping by init may take a moment
    if not _running(pid):
      break
    time.sleep(0.02)
  assert not _running(pid), f"background job {pid} still running"


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), 0, -1, True, "5", 1e300])
def test_a_per_call_timeout_is_checked_like_the_sandboxs(small, tmp_path, timeout_s):
  """run(timeout_s=...) was only float()ed: NaN and inf raised ValueError / OverflowError from deep
  inside, 0 and -1 'timed out', True and '5' ran, 1e300 was read as nsjail failing to start; each
  failed call leaked the two ends of nsjail's log pipe."""
  fds = len(os.listdir("/proc/self/fd"))
  for _ in range(3):
    with pytest.raises(ValueError, match=r"Sandbox.run: timeout_s=.* must be a finite number of seconds > 0"):
      small.run("echo hi", tmp_path, timeout_s=timeout_s)
  assert len(os.listdir("/proc/self/fd")) == fds


def test_a_tmpdir_nsjail_cannot_mount_is_a_config_error_not_an_unsafe_sandbox(tmp_path, monkeypatch):
  """The probe built its directory from $TMPDIR unchecked: a ':' in it failed every nsjail mode, and
  allow_unsafe=True then ran commands unconfined on a machine where nsjail works."""
  bad = tmp_path / "a:b"
  bad.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(bad))
  with pytest.raises(ConfigError, match=r"from TMPDIR\) contains ':'"):
    Sandbox(memory_mb=97, allow_unsafe=True)  # a size no other test probes with (probes are cached)
  assert os.listdir(bad) == []


def test_a_binary_that_is_not_nsjail_is_unavailable_not_an_oserror(tmp_path):
  """An executable nsjail that the kernel cannot run raised a bare OSError (Exec format error), so
  allow_unsafe had no effect."""
  fake = tmp_path / "nsjail"
  fake.write_bytes(b"\x7fELF not really")
  fake.chmod(0o755)
  with pytest.raises(SandboxUnavailable, match="cannot be run: .*Exec format error"):
    Sandbox(nsjail=str(fake))
  with pytest.warns(RuntimeWarning, match="SANDBOX DISABLED"):
    assert Sandbox(nsjail=str(fake), allow_unsafe=True).mode == "unsafe"


@pytest.mark.parametrize("size_mb", [0, 0.5, True, -1])
def test_a_task_tmpfs_of_no_size_is_refused_not_unlimited(tmp_path, size_mb):
  """size=0m is a tmpfs without a limit: disk_mb=0 (or 0.5, rounded down) gave an uncapped disk."""
  try:
    with pytest.raises(ValueError, match=r"mount_tmpfs: size_mb=.* must be an int >= 1"):
      taskdir.mount_tmpfs(tmp_path, size_mb)
  finally:  # what the mistake mounted
    if os.path.ismount(tmp_path):
      taskdir.unmount(tmp_path)
  with pytest.raises(ConfigError, match=r"EnvContext: disk_mb=.* must be an int >= 1"):
    EnvContext(root=tmp_path, disk_mb=size_mb)


@pytest.mark.parametrize("name,arguments", [("shell", {"command": "echo \ud800"}),
                                            ("write_file", {"path": "a.txt", "content": "x\udfffy"}),
                                            ("read_file", {"path": "\ud83d.txt"})])
def test_a_lone_surrogate_in_a_tool_call_is_a_tool_error(unsafe, tmp_path, name, arguments):
  """JSON's "\\ud800" parses to a lone surrogate, which no command line or file name can hold: the
  call raised UnicodeEncodeError out of the environment instead of telling the model."""
  with pytest.raises(ToolError, match="a lone UTF-16 surrogate"):
    files.FileTools(tmp_path, unsafe).call(name, arguments)
  assert os.listdir(tmp_path) == []
