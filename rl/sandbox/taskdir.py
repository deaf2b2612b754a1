"""Size-capped task directories: each episode's directory is its own tmpfs where we may mount one.

`--rlimit_fsize` caps one file, not a directory: one shell command (`for i in ...; do head -c
60M /dev/zero > f$i; done`) could fill the host's disk, which checkpoints and results share.
As root on Linux, an episode's directory is a tmpfs of `size_mb` (writes past it fail with
"No space left on device", inside the sandbox and through the file tools alike), unmounted when
the episode closes. Elsewhere (no root, no mount) it is an ordinary directory and
`mount_tmpfs` says why; the caller logs that once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys
from pathlib import Path

_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2


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
