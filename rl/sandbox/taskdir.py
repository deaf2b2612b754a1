"""Size-capped task directories: each episode's directory is its own tmpfs where we may mount one.

`--rlimit_fsize` caps one file, not a directory: one shell command (`for i in ...; do head -c
60M /dev/zero > f$i; done`) could fill the host's disk, which checkpoints and results share.
As root on Linux, an episode's directory is a tmpfs of `size_mb` (writes past it fail with
"No space left on device", inside the sandbox and through the file tools alike), unmounted when
the episode closes. Elsewhere (no root, no mount) it is an ordinary directory and
`mount_tmpfs` says why; the caller logs that once.

A process killed with SIGKILL (an OOM kill, a preemption) unmounts nothing, and a tmpfs keeps
its files in memory until reboot. Directory names therefore carry their process id
(`episode_prefix`, `ROOT_PREFIX`), and the next `rl.envs.base.EnvContext` sweeps the mounts and
roots of processes that no longer exist (`sweep_stale`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import shutil
import sys
from pathlib import Path

_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2
ROOT_PREFIX = "horizon_envs_"  # + "<pid>_": a context's own root under the temp directory
_OWNED = re.compile(r"^(?:hzn|horizon_envs_)(\d+)[-_]")  # episode directories and own roots


def episode_prefix(name: str) -> str:
  """The mkdtemp prefix of an episode directory: this process's id, then the task's name."""
  return f"hzn{os.getpid()}-{name}_"


def _libc():
  return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def mount_tmpfs(path: Path, size_mb: int) -> str | None:
  """Mounts a tmpfs of size_mb MiB (mode 0700) on the empty directory `path`.

  Returns None when mounted, else why not (not Linux, not root, or the mount call's error).
  """
  if not sys.platform.startswith("linux"):
    return f"{sys.platform} has no tmpfs mounts here"
  if os.geteuid() != 0:
    return "mounting a tmpfs needs root"
  options = f"size={int(size_mb)}m,mode=0700".encode()
  if _libc().mount(b"tmpfs", os.fsencode(path), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
    err = ctypes.get_errno()
    return f"mount(tmpfs) failed: {errno.errorcode.get(err, err)} ({os.strerror(err)})"
  return None


def unmount(path: Path) -> None:
  """Detaches the tmpfs at `path` (lazily: a process still inside cannot keep it busy)."""
  if _libc().umount2(os.fsencode(path), _MNT_DETACH) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"umount {path}: {os.strerror(err)}")


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  return True


def _stale(path: Path) -> bool:
  m = _OWNED.match(path.name)
  return bool(m) and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1)))


def _mount_points() -> list[Path]:
  """Mount points of this mount namespace, from /proc/self/mountinfo (octal escapes decoded)."""
  try:
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
  except OSError:
    return []
  decode = lambda s: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)  # noqa: E731
  return [Path(decode(line.split()[4])) for line in lines if len(line.split()) > 4]


def sweep_stale(root: Path, temp_dir: Path | None = None) -> list[Path]:
  """Unmounts and removes the episode directories under `root`, and the own roots under
  `temp_dir`, of processes that no longer exist; returns what it removed. Directories of live
  processes, and any not named by `episode_prefix` / ROOT_PREFIX, are left alone."""
  root = Path(os.path.realpath(root))  # as /proc lists it
  stale_roots = [Path(os.path.realpath(p)) for p in temp_dir.glob(ROOT_PREFIX + "*")] if temp_dir else []
  roots = [root] + [p for p in stale_roots if _stale(p) and p != root]
  removed = []
  for mount in sorted(_mount_points(), key=lambda p: -len(p.parts)):  # the deepest first
    if any(mount.parent == r for r in roots) and (_stale(mount) or _stale(mount.parent)):
      try:
        unmount(mount)
      except OSError:
        continue  # not ours to unmount (no root): leave its files
      shutil.rmtree(mount, ignore_errors=True)
      removed.append(mount)
  for r in roots[1:]:
    shutil.rmtree(r, ignore_errors=True)
    removed.append(r)
  if root.is_dir():
    for child in root.iterdir():  # unmounted leftovers (no tmpfs here) of dead processes
      if child.is_dir() and _stale(child) and child not in removed:
        shutil.rmtree(child, ignore_errors=True)
        removed.append(child)
  return removed
