"""run_capped, the capture under both sandbox back ends, driven with plain shell commands and
checked against byte counts and exit codes written out here (each test names the mistake it
catches: a cap off by one, dropped bytes not reported, a stream swapped, a deadline or a grace
period ignored)."""

import os
import sys
import time

import pytest

from rl.sandbox.capture import run_capped

ENV = {"PATH": "/usr/bin:/bin"}


def _sh(command, limit=10, timeout_s=10.0, **kwargs):
  return run_capped(["/bin/sh", "-c", command], env=ENV, cwd=None, timeout_s=timeout_s,
                    output_limit=limit, **kwargs)


@pytest.mark.parametrize("n,kept,truncated", [(9, 9, False), (10, 10, False), (11, 10, True)])
def test_the_cap_at_its_exact_edge(n, kept, truncated):
  """Exactly `output_limit` bytes is not truncated; one byte more is, and 10 are kept."""
  got = _sh(f"head -c {n} /dev/zero | tr '\\0' a")
  assert (got.stdout, got.stderr, got.truncated) == (b"a" * kept, b"", truncated)


def test_stdout_and_stderr_share_one_budget_in_their_own_buffers():
  got = _sh("printf 1234; sleep 0.2; printf abcdefgh >&2; sleep 0.2; printf 5678")
  assert (got.stdout, got.stderr, got.truncated, got.returncode) == (b"1234", b"abcdef", True, 0)


def test_output_is_bytes_as_written_not_decoded():
  got = _sh("printf '\\377\\376x'; printf '\\303' >&2")
  assert (got.stdout, got.stderr, got.truncated) == (b"\xff\xfex", b"\xc3", False)


@pytest.mark.parametrize("command,code", [("exit 0", 0), ("exit 3", 3), ("exit 255", 255),
                                          ("kill -TERM $$", 143), ("kill -KILL $$", 137)])
def test_exit_codes_and_128_plus_the_signal(command, code):
  got = _sh(command)
  assert (got.returncode, got.deadline_hit) == (code, False)


def test_the_deadline_kills_the_whole_group_at_the_timeout():
  """The children of the command (here a subshell's sleep) go with it; the deadline is the
  timeout, not the next poll a second later."""
  start = time.monotonic()
  got = _sh("(sleep 30; echo late) & echo started; sleep 30", timeout_s=1.0, limit=100)
  assert got.deadline_hit and got.stdout == b"started\n" and got.returncode == 143, got
  assert 1.0 <= got.wall_s < 1.9 and time.monotonic() - start < 1.9, got  # not at twice the timeout


def test_a_command_ignoring_sigterm_is_killed_a_second_later():
  start = time.monotonic()
  got = _sh("trap '' TERM; echo started; sleep 30", timeout_s=0.5, limit=100)
  assert (got.deadline_hit, got.stdout, got.returncode) == (True, b"started\n", 137), got
  assert 1.5 <= got.wall_s < 2.4 and time.monotonic() - start < 2.4, got


def test_a_background_process_holding_the_pipe_ends_after_a_short_grace():
  """The main process exits (silently, 0.3 s after its last output); its background child keeps
  stdout open: the capture returns within a poll (1 s) and a grace (0.2 s), not at the deadline
  (20 s) or when the child ends (30 s), and the child is killed."""
  got = _sh("sleep 30 & echo $!; echo done; sleep 0.3", timeout_s=20.0, limit=100)
  pid = int(got.stdout.split()[0])
  assert (got.stdout.split()[1], got.returncode, got.deadline_hit) == (b"done", 0, False)
  assert got.wall_s < 3.0, got
  time.sleep(0.1)
  with open(f"/proc/{pid}/stat") if os.path.exists(f"/proc/{pid}/stat") else open(os.devnull) as f:
    state = f.read().split(") ")[-1][:1]
  assert state in ("", "Z"), state  # gone, or a zombie of init awaiting its reap


def test_stdin_is_empty_and_the_command_leads_its_own_session():
  """The command reads /dev/null, not what our own stdin holds (here a pipe with bytes in it)."""
  saved, (read_fd, write_fd) = os.dup(0), os.pipe()
  os.write(write_fd, b"ours")
  os.close(write_fd)
  os.dup2(read_fd, 0)
  try:
    got = run_capped([sys.executable, "-c", "import os, sys; print(repr(sys.stdin.read()), "
                      "os.getsid(0) == os.getpid())"], env=ENV, cwd=None, timeout_s=10.0, output_limit=100)
  finally:
    os.dup2(saved, 0)
    os.close(saved)
    os.close(read_fd)
  assert got.stdout == b"'' True\n", got


def test_the_log_pipe_keeps_64_kib():
  read_fd, write_fd = os.pipe()
  got = run_capped([sys.executable, "-c", f"import os; os.write({write_fd}, b'L' * 70000); print('out')"],
                   env=ENV, cwd=None, timeout_s=10.0, output_limit=100, log_pipe=(read_fd, write_fd))
  assert (got.log, got.stdout, got.truncated) == (b"L" * 65536, b"out\n", False)
  for fd in (read_fd, write_fd):
    with pytest.raises(OSError):
      os.fstat(fd)  # both ends closed by run_capped
