"""Running one process with capped, incrementally read output and a wall-clock deadline.

Both sandbox back ends (nsjail and the explicit unsafe fallback) go through `run_capped`, so
the two ways of running a command agree on truncation, timeouts and exit codes. The pipes are
read in chunks as they fill: bytes past the cap are read and dropped, never kept, so a
command that prints 100 MB costs the host one read buffer, not 100 MB.
"""

from __future__ import annotations

import dataclasses
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

_CHUNK = 1 << 16
# After the main process exits, how long to keep reading pipes that a stray background
# process may still hold open (only possible in the unsafe back end; nsjail's PID namespace
# dies with its init). What is left of the process group is then killed, whether or not it
# holds a pipe, so the two back ends agree: nothing a command started outlives it.
_DRAIN_GRACE_S = 0.2


@dataclasses.dataclass
class Captured:
  """What `run_capped` saw: kept bytes per stream, whether bytes were dropped, how it ended."""
  returncode: int
  stdout: bytes
  stderr: bytes
  log: bytes
  truncated: bool
  deadline_hit: bool
  wall_s: float


class _Sink:
  """Keeps bytes of several streams up to one shared budget and counts what it dropped."""

  def __init__(self, limit: int):
    self.left = limit
    self.dropped = 0

  def take(self, buf: bytearray, data: bytes) -> None:
    keep = data[:max(self.left, 0)]
    buf += keep
    self.left -= len(keep)
    self.dropped += len(data) - len(keep)


def run_capped(argv: Sequence[str], *, env: Mapping[str, str], cwd: str | None, timeout_s: float,
               output_limit: int, log_pipe: tuple[int, int] | None = None,
               preexec_fn: Callable[[], None] | None = None) -> Captured:
  """Runs argv (stdin from /dev/null), keeping at most `output_limit` bytes of stdout+stderr.

  Args:
    argv: the program and its arguments.
    env: the complete environment of the process.
    cwd: its working directory (None: ours).
    timeout_s: wall-clock limit; past it the whole process group is killed (SIGKILL), also when
      the process has closed or redirected its stdout and stderr (`exec >log 2>&1`).
    output_limit: bytes of stdout and stderr kept together; the rest is read and dropped.
    log_pipe: (read fd, write fd) of an extra pipe (e.g. nsjail's `--log_fd`): the write end
      is inherited by the child, the read end collected (64 KiB at most); both are closed here.
    preexec_fn: run in the child before exec (rlimits of the unsafe back end).

  Returns:
    The captured streams; returncode is 128 + signal for a process killed by a signal. When it
    returns, nothing of the process group is left running (background jobs included).
  """
  start = time.monotonic()
  try:
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(env), cwd=cwd, start_new_session=True,
                            preexec_fn=preexec_fn, pass_fds=(log_pipe[1],) if log_pipe else ())
  except BaseException:
    if log_pipe:
      os.close(log_pipe[0])
      os.close(log_pipe[1])
    raise
  bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
  sinks = dict.fromkeys(bufs, _Sink(output_limit))  # one budget for stdout and stderr together
  if log_pipe:
    os.close(log_pipe[1])
    bufs[log_pipe[0]] = bytearray()
    sinks[log_pipe[0]] = _Sink(64 * 1024)
  out, err = bufs[proc.stdout.fileno()], bufs[proc.stderr.fileno()]
  out_sink = sinks[proc.stdout.fileno()]  # one sink shared by stdout and stderr
  try:
    deadline_hit = _pump(proc, bufs, sinks, start + timeout_s)
    returncode = proc.wait()
  finally:
    if proc.poll() is None:  # interrupted (e.g. KeyboardInterrupt): leave nothing running
      _stop(proc)
    _kill_group(proc)  # background jobs that closed their pipes (`server >/dev/null 2>&1 &`)
    proc.stdout.close()
    proc.stderr.close()
    if log_pipe:
      os.close(log_pipe[0])
  if returncode < 0:
    returncode = 128 - returncode
  log = bytes(bufs[log_pipe[0]]) if log_pipe else b""
  truncated = out_sink.dropped > 0
  return Captured(returncode, bytes(out), bytes(err), log, truncated, deadline_hit,
                  time.monotonic() - start)


def _pump(proc: subprocess.Popen, bufs: dict[int, bytearray], sinks: dict[int, _Sink],
          deadline: float) -> bool:
  """Reads every pipe until EOF (or a short grace after exit) and the process has exited (the
  deadline applies after the pipes close too); True iff the deadline hit."""
  sel = selectors.DefaultSelector()
  for fd in bufs:
    sel.register(fd, selectors.EVENT_READ)
  deadline_hit, exited_at = False, None
  try:
    while sel.get_map() or proc.poll() is None:
      now = time.monotonic()
      if proc.poll() is None:
        if now >= deadline:
          deadline_hit = True
          _stop(proc)
          continue
        wait = deadline - now
      else:
        exited_at = exited_at or now
        if now - exited_at > _DRAIN_GRACE_S:
          _kill_group(proc)  # a stray background process holds a pipe open
          break
        wait = _DRAIN_GRACE_S
      if not sel.get_map():  # every pipe is closed but the process runs on: wait for it
        try:
          proc.wait(timeout=max(min(wait, 1.0), 0.005))
        except subprocess.TimeoutExpired:
          pass
        continue
      for key, _ in sel.select(timeout=max(min(wait, 1.0), 0.005)):
        data = os.read(key.fd, _CHUNK)
        if data:
          sinks[key.fd].take(bufs[key.fd], data)
        else:
          sel.unregister(key.fd)
  finally:
    sel.close()
  return deadline_hit


def _stop(proc: subprocess.Popen) -> None:
  """SIGTERM first (nsjail then kills its jail and removes its cgroups; a SIGKILLed nsjail
  leaks them), SIGKILL to the whole group after a second (the unsafe back end's children)."""
  proc.terminate()
  try:
    proc.wait(timeout=1.0)
  except subprocess.TimeoutExpired:
    pass
  _kill_group(proc)
  proc.wait()


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
