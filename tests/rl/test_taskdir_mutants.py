"""Task directories: the sweep of what dead processes left, the mount table it reads and the
tmpfs refusal without root, each against names and values written out here (each test names the
mistake it catches)."""

import os
from pathlib import Path

import pytest

from rl.sandbox import taskdir
from tests.helpers import isolation_unavailable

DEAD = 4194305  # above the largest pid_max Linux allows (2**22): never a live process


def _tree(tmp_path):
  root, temp = tmp_path / "root", tmp_path / "temp"
  me = os.getpid()
  names = {root: [f"hzn{DEAD}-a_x", f"hzn{me}-b_x", "hzn1-c_x", f"old_hzn{DEAD}-d_x", "plain"],
           temp: [f"horizon_envs_{DEAD}_x", f"horizon_envs_{me}_y", "horizon_envs_1_z",
                  f"horizon_other_{DEAD}_w"]}
  for parent, children in names.items():
    for name in children:
      (parent / name / "sub").mkdir(parents=True)
      (parent / name / "sub" / "f").write_text(name)
  (root / f"hzn{DEAD}-file_x").write_text("a file, not a task directory")
  return root, temp


def test_the_sweep_removes_the_directories_of_dead_processes_only(tmp_path):
  """Catches the pid checks dropped (a live or our own process's directory removed), the name
  matched anywhere (`old_hzn...`), and files or unrelated names under the temp directory taken."""
  root, temp = _tree(tmp_path)
  removed = taskdir.sweep_stale(root, temp)
  assert sorted(removed) == [root / f"hzn{DEAD}-a_x", temp / f"horizon_envs_{DEAD}_x"]
  assert sorted(p.name for p in root.iterdir()) == sorted(
    [f"hzn{os.getpid()}-b_x", "hzn1-c_x", f"hzn{DEAD}-file_x", f"old_hzn{DEAD}-d_x", "plain"])
  assert sorted(p.name for p in temp.iterdir()) == sorted(
    [f"horizon_envs_{os.getpid()}_y", "horizon_envs_1_z", f"horizon_other_{DEAD}_w"])
  assert taskdir.sweep_stale(root, temp) == []  # nothing left to sweep


def test_the_sweep_without_a_temp_directory_leaves_the_temp_roots(tmp_path):
  root, temp = _tree(tmp_path)
  assert taskdir.sweep_stale(root) == [root / f"hzn{DEAD}-a_x"]
  assert (temp / f"horizon_envs_{DEAD}_x" / "sub" / "f").read_text() == f"horizon_envs_{DEAD}_x"


def test_a_pid_we_may_not_signal_is_alive(tmp_path, monkeypatch):
  """Another user's process (kill answers EPERM) still exists: its directory is not stale."""
  def refuse(pid, sig):
    raise PermissionError(1, "Operation not permitted")

  (tmp_path / "hzn77-a_x").mkdir()
  monkeypatch.setattr(os, "kill", refuse)
  assert taskdir.sweep_stale(tmp_path) == [] and (tmp_path / "hzn77-a_x").is_dir()


def test_a_pid_too_large_for_the_kernel_is_not_a_crash(tmp_path):
  """Any user could make /tmp/horizon_envs_99999999999999999999_x: os.kill raised OverflowError
  out of the sweep, and every EnvContext() failed. No process has that id: the name is stale."""
  huge = "9" * 20
  (tmp_path / "root" / f"hzn{huge}-a_x").mkdir(parents=True)
  (tmp_path / f"horizon_envs_{huge}_y").mkdir()
  removed = taskdir.sweep_stale(tmp_path / "root", tmp_path)
  assert sorted(removed) == [tmp_path / f"horizon_envs_{huge}_y", tmp_path / "root" / f"hzn{huge}-a_x"]


def test_the_episode_prefix_is_the_pid_then_the_name():
  assert taskdir.episode_prefix("t 1") == f"hzn{os.getpid()}-t 1_"


def test_a_tmpfs_needs_root(tmp_path, monkeypatch):
  """Catches the root check inverted: as root no task directory was capped."""
  monkeypatch.setattr(os, "geteuid", lambda: 1000)
  assert taskdir.mount_tmpfs(tmp_path, 4) == "mounting a tmpfs needs root"


def test_the_mount_table_decodes_escapes_and_bytes_that_are_not_utf8(tmp_path):
  """A mount point whose name is not UTF-8 raised UnicodeDecodeError out of the sweep (every
  EnvContext() failed); a space is written `\\040` in the table, a carriage return is not escaped."""
  path = Path(os.fsdecode(os.path.join(os.fsencode(str(tmp_path)), b"a b\xff\\c\rd")))
  path.mkdir()
  why_not = taskdir.mount_tmpfs(path, 1)
  if why_not is not None:
    isolation_unavailable(why_not)
  try:
    assert path in taskdir._mount_points()
    assert taskdir.sweep_stale(tmp_path) == []
  finally:
    taskdir.unmount(path)
  assert path not in taskdir._mount_points()


def test_remove_tree_of_a_link_removes_the_link_only(tmp_path):
  """Catches stat for lstat: the link's target directory was emptied and removed."""
  target = tmp_path / "target"
  (target / "d").mkdir(parents=True)
  (target / "d" / "keep").write_text("keep")
  (tmp_path / "link").symlink_to(target, target_is_directory=True)
  taskdir.remove_tree(tmp_path / "link")
  assert not os.path.lexists(tmp_path / "link") and (target / "d" / "keep").read_text() == "keep"


def test_remove_tree_raises_the_first_error_and_removes_the_rest(tmp_path, monkeypatch):
  """What cannot be removed is raised (the first error met), after the rest is gone."""
  root = tmp_path / "t"
  for rel in ("a/x", "b/y"):
    (root / rel).mkdir(parents=True)
    (root / rel / "f").write_text(rel)
  real = os.unlink

  def unlink(name, *args, dir_fd=None):
    if name == "f":
      raise PermissionError(1, "refused", name)
    return real(name, *args, dir_fd=dir_fd)

  monkeypatch.setattr(os, "unlink", unlink)
  with pytest.raises(PermissionError, match="refused"):
    taskdir.remove_tree(root)
  monkeypatch.undo()
  assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == [".rm0/f", ".rm1/f"]
  taskdir.remove_tree(root)
  assert not root.exists()


def test_remove_quietly_says_whether_the_path_is_gone(tmp_path, monkeypatch):
  (tmp_path / "d").mkdir()
  assert taskdir.remove_quietly(tmp_path / "d") is True and not (tmp_path / "d").exists()
  assert taskdir.remove_quietly(tmp_path / "missing") is True
  (tmp_path / "e").mkdir()
  monkeypatch.setattr(os, "rmdir", lambda *a, **k: (_ for _ in ()).throw(OSError(16, "busy")))
  assert taskdir.remove_quietly(tmp_path / "e") is False


def test_the_sweep_unmounts_under_the_roots_only(tmp_path):
  """Catches the parent check dropped (a tmpfs of a dead process's name anywhere unmounted) and
  the stale parent not looked at (a mount inside a dead process's own root left mounted)."""
  mine = tmp_path / "root" / "mine"
  points = [tmp_path / "root" / f"hzn{DEAD}-b_x", tmp_path / "temp" / f"horizon_envs_{DEAD}_x" / "plain",
            tmp_path / "elsewhere" / f"hzn{DEAD}-a_x", mine]
  for point in points:
    point.mkdir(parents=True)
  why_not = taskdir.mount_tmpfs(points[0], 1)
  if why_not is not None:
    isolation_unavailable(why_not)
  for point in points[1:]:
    assert taskdir.mount_tmpfs(point, 1) is None
  try:
    removed = taskdir.sweep_stale(tmp_path / "root", tmp_path / "temp")
    assert sorted(removed) == sorted([points[0], points[1], points[1].parent])
    assert [p for p in points if p in taskdir._mount_points()] == [points[2], mine]
    assert os.listdir(tmp_path / "temp") == [] and os.listdir(tmp_path / "root") == ["mine"]
  finally:
    for point in points:
      if point in taskdir._mount_points():
        taskdir.unmount(point)


def test_without_root_each_directory_is_made_ours_before_it_is_emptied(tmp_path, monkeypatch):
  """An agent's `chmod 0 d` left d unremovable by a host that is not root: each directory is
  made rwx for us (0700) first: the tree's top, then each met, before it is moved or opened."""
  (tmp_path / "t" / "a" / "b").mkdir(parents=True)
  calls = []
  monkeypatch.setattr(os, "geteuid", lambda: 1000)
  monkeypatch.setattr(os, "chmod", lambda name, mode, dir_fd=None: calls.append((str(name), oct(mode))))
  taskdir.remove_tree(tmp_path / "t")
  assert calls == [(str(tmp_path / "t"), "0o700"), ("a", "0o700"), ("b", "0o700"), (".rm0", "0o700")]
  assert not (tmp_path / "t").exists()
