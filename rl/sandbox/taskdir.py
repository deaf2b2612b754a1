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

The tmpfs caps inodes as well as bytes (`inode_cap`): an empty file costs no data but about
1 KiB of the host's kernel memory (inode and dentry), and a tmpfs's default of half the host's
RAM pages in inodes (~3M on the host audited) let 1.1M empty files grow the host's slab by more than 1 GB.

`remove_tree` removes a directory of any depth: shutil.rmtree and os.walk recurse in Python
3.11, and one shell command (`for i in $(seq 1100); do mkdir d; cd d; done`) builds a tree
deep enough to raise RecursionError in them, even under rmtree's ignore_errors=True.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import errno
import itertools
import logging
import os
import re
import stat
import sys
from pathlib import Path

from model.config import is_int

_log = logging.getLogger(__name__)

_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2
ROOT_PREFIX = "horizon_envs_"  # + "<pid>_": a context's own root under the temp directory
_OWNED = re.compile(r"^(?:hzn|horizon_envs_)(\d+)[-_]")  # episode directories and own roots
# Inodes (files, directories, links) of a task tmpfs: 64 per MiB of its size, i.e. one per 16 KiB
# of data when the disk is full, and never fewer than 4096. At the default 256 MiB that is 16384
# inodes, at most ~16 MiB of kernel memory (1/16 of the data cap); generated tasks write a few
# dozen files, and a Python project of a few hundred files, a git repository or a build tree
# fit many times over.
INODES_PER_MB = 64
MIN_INODES = 4096
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def episode_prefix(name: str) -> str:
  """The mkdtemp prefix of an episode directory: this process's id, then the task's name."""
  return f"hzn{os.getpid()}-{name}_"


def _libc():
  return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def inode_cap(size_mb: int) -> int:
  """How many inodes a task tmpfs of size_mb MiB holds (see INODES_PER_MB)."""
  return max(MIN_INODES, INODES_PER_MB * int(size_mb))


def mount_tmpfs(path: Path, size_mb: int) -> str | None:
  """Mounts a tmpfs of size_mb MiB and inode_cap(size_mb) inodes (mode 0700) on the empty
  directory `path`.

  Returns None when mounted, else why not (not Linux, not root, or the mount call's error).
  Raises ValueError for a size that is not an int >= 1 (tmpfs reads size=0 as no limit).
  """
  if not is_int(size_mb, numpy=True) or size_mb < 1:
    raise ValueError(f"mount_tmpfs: size_mb={size_mb!r} must be an int >= 1 (tmpfs reads 0 as no limit).")
  if not sys.platform.startswith("linux"):
    return f"{sys.platform} has no tmpfs mounts here"
  if os.geteuid() != 0:
    return "mounting a tmpfs needs root"
  options = f"size={int(size_mb)}m,nr_inodes={inode_cap(size_mb)},mode=0700".encode()
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
  except (ProcessLookupError, OverflowError):  # OverflowError: past any pid (a name's digits)
    return False
  except PermissionError:  # another user's process
    return True
  return True


def _stale(path: Path) -> bool:
  m = _OWNED.match(path.name)
  return bool(m) and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1)))


def _mount_points() -> list[Path]:
  """Mount points of this mount namespace, from /proc/self/mountinfo (octal escapes decoded; the
  bytes of a name as os.listdir gives them, so a name that is not UTF-8 neither fails nor differs)."""
  try:
    lines = Path("/proc/self/mountinfo").read_bytes().split(b"\n")  # the kernel escapes only " \t\n\\"
  except OSError:
    return []
  unescape = lambda s: re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), s)  # noqa: E731
  fields = [line.split(b" ") for line in lines]  # one space between fields; a name's own are escaped
  return [Path(os.fsdecode(unescape(f[4]))) for f in fields if len(f) > 4]


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
      remove_quietly(mount)
      removed.append(mount)
  for r in roots[1:]:
    remove_quietly(r)
    removed.append(r)
  if root.is_dir():
    for child in root.iterdir():  # unmounted leftovers (no tmpfs here) of dead processes
      if child.is_dir() and _stale(child) and child not in removed:
        remove_quietly(child)
        removed.append(child)
  return removed


def remove_tree(path: Path | str) -> None:
  """Removes `path` and everything under it, however deep; never follows a symlink.

  Iterative and by directory fds: each subdirectory met is moved up into `path` itself (a
  rename within one file system) and emptied there in turn, the emptied ones removed at the
  end; so at most two directories are open at a time, no path grows past two names (a chain
  deeper than PATH_MAX is fine) and the work is linear in the entries. Nothing of the agent
  may run meanwhile (as for every host-side use of a task directory). A missing `path` is no
  error; otherwise it removes what it can, then raises the first OSError met.
  """
  try:
    if not stat.S_ISDIR(os.lstat(path).st_mode):
      os.unlink(path)
      return
  except FileNotFoundError:
    return
  errors: list[OSError] = []
  _unlock(path, None)
  top = os.open(path, _DIR_FLAGS)
  try:
    pending = collections.deque(_clear_files(top, errors))
    own = set(pending)  # names in `path` that a moved directory must not take
    fresh = (f".rm{i}" for i in itertools.count() if f".rm{i}" not in own)
    emptied = []  # removed at the end: on ext4 an rmdir right after a rename out of it costs ~2 ms
    while pending:
      name = pending.popleft()
      _unlock(name, top)
      try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=top)
      except OSError as e:
        errors.append(e)
        continue
      try:
        for sub in _clear_files(fd, errors):
          _unlock(sub, fd)  # moving a directory rewrites its '..': it must be writable
          new = next(fresh)
          if _attempt(errors, os.rename, sub, new, src_dir_fd=fd, dst_dir_fd=top):
            pending.append(new)
      finally:
        os.close(fd)
      emptied.append(name)
    for name in emptied:
      _attempt(errors, os.rmdir, name, dir_fd=top)
  finally:
    os.close(top)
  _attempt(errors, os.rmdir, path)
  if errors:
    raise errors[0]


def remove_quietly(path: Path | str) -> bool:
  """remove_tree that logs a failure instead of raising it; True when `path` is gone."""
  try:
    remove_tree(path)
    return True
  except Exception as e:  # a close or a sweep must never fail on what it leaves behind
    _log.warning("cannot remove %s: %s: %s", path, type(e).__name__, e)
    return False


def _clear_files(fd: int, errors: list[OSError]) -> list[str]:
  """Unlinks every entry of the directory `fd` but its subdirectories; returns their names."""
  subdirs = []
  try:
    with os.scandir(fd) as entries:
      for entry in entries:
        if entry.is_dir(follow_symlinks=False):
          subdirs.append(entry.name)
        else:
          _attempt(errors, os.unlink, entry.name, dir_fd=fd)
  except OSError as e:
    errors.append(e)
  return subdirs


def _attempt(errors: list[OSError], fn, *args, **kwargs) -> bool:
  """fn(*args, **kwargs); an OSError is recorded in `errors` (False) instead of raised."""
  try:
    fn(*args, **kwargs)
    return True
  except OSError as e:
    errors.append(e)
    return False


def _unlock(name: Path | str, dir_fd: int | None) -> None:
  """Without root, a directory the agent made unreadable (chmod 0) is made ours to empty."""
  if os.geteuid() != 0:
    try:
      os.chmod(name, stat.S_IRWXU, dir_fd=dir_fd)
    except OSError:
      pass
