"""The nsjail sandbox: each hostile command is contained, the host is unaffected, and the
sandbox still runs the next command."""

import os
import re
import resource
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from rl.sandbox import Sandbox, SandboxUnavailable, taskdir
from rl.sandbox.sandbox import SANDBOX_UID
from tests.helpers import isolation_unavailable

CAP = 64 * 1024


@pytest.fixture(scope="module")
def sandbox():
  try:
    return Sandbox(memory_mb=128, max_pids=32, output_limit_bytes=CAP, timeout_s=5.0)
  except SandboxUnavailable as e:
    isolation_unavailable(f"nsjail cannot run here: {e}")


@pytest.fixture
def task_dir(tmp_path):
  d = tmp_path / "task"
  d.mkdir()
  return d


def _still_works(sandbox, task_dir):
  result = sandbox.run("echo alive > alive.txt && cat alive.txt", task_dir)
  assert (result.exit_code, result.stdout) == (0, "alive\n")
  assert (task_dir / "alive.txt").read_text() == "alive\n"


def _jailed_processes() -> int:
  """Processes of the sandbox uid on the host (must be 0 after any command returns)."""
  count = 0
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      if os.stat(f"/proc/{pid}").st_uid == SANDBOX_UID:
        count += 1
    except FileNotFoundError:
      pass
  return count


def test_output_exit_code_and_cwd(sandbox, task_dir):
  (task_dir / "in.txt").write_text("hello\n")
  result = sandbox.run("pwd; cat in.txt; echo oops >&2; exit 3", task_dir)
  assert result.exit_code == 3
  assert result.stdout == "/task\nhello\n" and result.stderr == "oops\n"
  assert not (result.timed_out or result.truncated or result.killed_reason)
  version = sandbox.run("/usr/bin/python3 -c 'import sys; print(sys.version_info[:2])'", task_dir)
  assert version.stdout.strip() == "(3, 11)", version
  _still_works(sandbox, task_dir)


def test_network_is_unreachable(sandbox, task_dir):
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(4)
  server.settimeout(0.2)
  port = server.getsockname()[1]
  accepted = []

  def serve():
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
      try:
        accepted.append(server.accept()[0])
      except OSError:
        pass

  thread = threading.Thread(target=serve, daemon=True)
  thread.start()
  probe = (f"python3 -c \"import socket; s = socket.socket(); s.settimeout(2); "
           f"s.connect(('127.0.0.1', {port})); print('CONNECTED')\"")
  result = sandbox.run(probe, task_dir)
  assert result.exit_code != 0 and "CONNECTED" not in result.stdout
  assert "ConnectionRefusedError" in result.stderr or "timed out" in result.stderr, result.stderr
  with socket.create_connection(("127.0.0.1", port), timeout=2):  # the host itself can connect
    pass
  thread.join()
  server.close()
  assert len(accepted) == 1  # only the host's own connection
  _still_works(sandbox, task_dir)


def test_writes_outside_the_task_dir_fail(sandbox, task_dir):
  name = f"horizon_sandbox_test_{uuid.uuid4().hex}"
  targets = [f"/work/{name}", f"/etc/{name}", f"/root/{name}", f"/usr/{name}", f"/{name}"]
  result = sandbox.run("; ".join(f"echo x > {t} && echo WROTE {t}" for t in targets)
                       + "; ls /work /root 2>&1; touch /tmp/ok && echo TMP_OK", task_dir)
  assert "WROTE" not in result.stdout, result.stdout
  assert "TMP_OK" in result.stdout  # the private /tmp is writable
  for target in targets:
    assert not os.path.exists(target)
  _still_works(sandbox, task_dir)


_TAMPER = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
parent = os.getppid()
class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
buf = ctypes.create_string_buffer(8)
vec = IoVec(ctypes.addressof(buf), 8)
for name, call in (("attach", lambda: libc.ptrace(16, parent, None, None)),
                   ("seize", lambda: libc.ptrace(0x4206, parent, None, None)),
                   ("vm_writev", lambda: libc.process_vm_writev(parent, ctypes.byref(vec), 1,
                                                                ctypes.byref(vec), 1, 0))):
    print(name, "ok" if call() >= 0 else "refused")
try:
    open(f"/proc/{parent}/mem", "rb+")
    print("mem ok")
except OSError:
    print("mem refused")
"""


def test_a_command_cannot_tamper_with_its_parent(sandbox, task_dir):
  """The code tasks' checker starts the agent's code as its child (code_checker.py): that child
  must not be able to rewrite the checker's memory. ptrace and process_vm_writev are refused by
  the seccomp policy and /proc is read-only, whatever the host's Yama setting."""
  (task_dir / "tamper.py").write_text(_TAMPER)
  result = sandbox.run("python3 -c 'import subprocess, sys; "
                       "subprocess.run([sys.executable, \"tamper.py\"])'", task_dir)
  assert result.stdout.split("\n")[:4] == ["attach refused", "seize refused", "vm_writev refused",
                                           "mem refused"], result.stdout + result.stderr


def test_fork_bomb_is_contained(sandbox, task_dir):
  start = time.monotonic()
  result = sandbox.run(":(){ :|:& };:", task_dir, timeout_s=4)
  assert time.monotonic() - start < 10
  assert result.wall_s < 10
  time.sleep(0.2)
  assert _jailed_processes() == 0  # nothing escaped into the host's process table
  _still_works(sandbox, task_dir)


def test_memory_hog_is_killed_at_the_limit(sandbox, task_dir):
  hog = "python3 -c 'chunks = []\nwhile True: chunks.append(bytearray(16 * 2**20))'"
  result = sandbox.run(hog, task_dir, timeout_s=20)
  assert result.exit_code != 0 and not result.timed_out
  assert result.wall_s < 20
  if sandbox.limits.mode.startswith("cgroup"):
    assert result.exit_code == 137 and "memory" in result.killed_reason
  else:  # RLIMIT_AS: the allocation fails inside python
    assert "MemoryError" in result.stderr
  _still_works(sandbox, task_dir)


def test_infinite_loop_is_killed_at_the_time_limit(sandbox, task_dir):
  result = sandbox.run("while :; do :; done", task_dir, timeout_s=1.5)
  assert result.timed_out and "time limit" in result.killed_reason
  assert 1.4 <= result.wall_s < 4
  _still_works(sandbox, task_dir)


def test_huge_output_is_truncated_without_buffering(sandbox, task_dir):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  result = sandbox.run("head -c 100000000 /dev/zero | tr '\\0' y; echo tail-marker", task_dir, timeout_s=30)
  grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
  assert result.exit_code == 0 and result.truncated
  assert len(result.stdout.encode()) + len(result.stderr.encode()) <= CAP
  assert result.stdout.startswith("yyyy") and "tail-marker" not in result.stdout
  assert grown_mb < 50, f"the host kept {grown_mb:.0f} MB of output"
  _still_works(sandbox, task_dir)


def test_task_dir_under_a_private_parent(sandbox, tmp_path):
  parent = tmp_path / "private"
  parent.mkdir(mode=0o700)
  task_dir = parent / "task"
  task_dir.mkdir()
  result = sandbox.run("echo made > made.txt", task_dir)
  assert result.exit_code == 0, result
  assert (task_dir / "made.txt").read_text() == "made\n"


def test_missing_nsjail_is_reported_and_unsafe_is_loud(tmp_path):
  with pytest.raises(SandboxUnavailable, match="missing or not executable"):
    Sandbox(nsjail="/nonexistent/nsjail")
  with pytest.warns(RuntimeWarning, match="SANDBOX DISABLED"):
    unsafe = Sandbox(nsjail="/nonexistent/nsjail", allow_unsafe=True, output_limit_bytes=100)
  assert unsafe.mode == "unsafe"
  result = unsafe.run("echo hi; exit 4", Path(tmp_path))
  assert (result.exit_code, result.stdout) == (4, "hi\n")
  big = unsafe.run("head -c 100000 /dev/zero | tr '\\0' y", Path(tmp_path))
  assert big.truncated and len(big.stdout) == 100
  slow = unsafe.run("sleep 5", Path(tmp_path), timeout_s=0.5)
  assert slow.timed_out and slow.wall_s < 3


def test_zero_limits_are_refused_not_read_as_unlimited():
  """nsjail reads a limit of 0 as no limit; the sandbox and config.env refuse it, naming the field."""
  for kw, name in ((dict(memory_mb=0), "memory_mb=0"), (dict(max_pids=0), "max_pids=0"),
                   (dict(output_limit_bytes=-1), "output_limit_bytes=-1"), (dict(tmp_mb=0), "tmp_mb=0")):
    with pytest.raises(ValueError, match=f"Sandbox: {name} must be an int >= 1"):
      Sandbox(nsjail="/nonexistent/nsjail", allow_unsafe=True, **kw)
  with pytest.raises(ValueError, match="Sandbox: timeout_s=-1 must be a finite number of seconds > 0"):
    Sandbox(nsjail="/nonexistent/nsjail", allow_unsafe=True, timeout_s=-1)

  from configs import sft
  from rl.envs.base import EnvContext
  for field, value, message in (("memory_mb", 0, "memory_mb=0: must be an int >= 1"),
                                ("max_pids", 0, "max_pids=0: must be an int >= 1"),
                                ("workers", 0, "workers=0: must be an int >= 1"),
                                ("max_tokens_per_turn", 0, "max_tokens_per_turn=0: must be an int >= 1"),
                                ("max_turns", 0, "max_turns=0: must be an int >= 1"),
                                ("output_limit_bytes", -1, "output_limit_bytes=-1: must be an int >= 1"),
                                ("command_timeout_s", -1.0, "command_timeout_s=-1.0: must be a finite"),
                                ("executor", "process", "executor='process': choose 'thread' or 'ray'")):
    env = sft.get_config("tiny").env
    env[field] = value
    with pytest.raises(ValueError, match=re.escape(f"config.env.{message}")):
      EnvContext.from_config(env)
  assert EnvContext.from_config(sft.get_config("tiny").env).memory_mb == 512


def test_the_hand_over_does_not_walk_the_task_directory(sandbox, task_dir, monkeypatch):
  """Before every command the host walked the whole task directory (lstat, maybe lchown, per
  entry): at 300k files a `true` took 1.2 s of host work. Its cost no longer grows with the tree."""
  assert sandbox.run("mkdir -p a/b && touch f{1..1500} a/g{1..500} a/b/h{1..500}", task_dir).exit_code == 0
  calls = []

  def counted(real):
    def call(path, *args, **kwargs):
      if str(path).startswith(str(task_dir)):
        calls.append(path)
      return real(path, *args, **kwargs)
    return call

  for name in ("lstat", "stat", "lchown", "chown", "scandir"):
    monkeypatch.setattr(os, name, counted(getattr(os, name)))
  result = sandbox.run("true", task_dir)
  monkeypatch.undo()
  assert result.exit_code == 0
  assert len(calls) < 10, f"{len(calls)} file-system calls in the task directory for one command"


def test_a_deep_directory_tree_breaks_no_later_command(sandbox, task_dir):
  """1100 nested directories made every later command fail with RecursionError (os.walk)."""
  deep = "python3 -c 'import os\nfor _ in range(1100):\n  os.mkdir(\"d\"); os.chdir(\"d\")'"
  try:
    assert sandbox.run(deep, task_dir).exit_code == 0
    _still_works(sandbox, task_dir)
  finally:
    taskdir.remove_tree(task_dir / "d")
  assert sorted(os.listdir(task_dir)) == ["alive.txt"]


def test_remove_tree_is_iterative_and_never_follows_links(tmp_path):
  """shutil.rmtree recurses (Python 3.11): a deep tree raised RecursionError even with
  ignore_errors=True. remove_tree removes any depth (here past PATH_MAX), never through a link."""
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "keep.txt").write_text("keep")
  root = tmp_path / "tree"
  root.mkdir()
  fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
  for i in range(1500):  # past the recursion limit, and 1500 x 11 bytes of path: past PATH_MAX
    if i % 250 == 0:
      os.close(os.open("file", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
      os.symlink(outside, "link", dir_fd=fd)
      os.mkfifo("fifo", dir_fd=fd)
      for j in range(20):
        os.mkdir(f"wide{j}", dir_fd=fd)
        os.close(os.open(f"wide{j}/x", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    os.mkdir("directory_", dir_fd=fd)
    child = os.open("directory_", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
    os.close(fd)
    fd = child
  os.close(fd)
  taskdir.remove_tree(root)
  assert not root.exists() and (outside / "keep.txt").read_text() == "keep"
  taskdir.remove_tree(root)  # gone already: nothing to do
  (tmp_path / "file").write_text("x")
  taskdir.remove_tree(tmp_path / "file")
  assert sorted(os.listdir(tmp_path)) == ["outside"]
