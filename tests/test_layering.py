"""The package layering of ARCHITECTURE.md is enforced by `lint-imports` (import-linter).

The contracts live in `pyproject.toml`. These tests show that the real tree keeps them and that
each kind of contract bites: a copy of the source tree with one offending module added must make
`lint-imports` exit non-zero, naming the broken contract.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("configs", "experiments", "rl", "serving", "training", "model", "sharding", "pallas_kernels",
            "tests")
LINT = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")


def _lint(cwd: Path) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=str(cwd))
  return subprocess.run([LINT, "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=300)


def _copy_tree(dst: Path) -> None:
  shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
  for pkg in PACKAGES:
    shutil.copytree(ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__", "assets", "*.json"))


def test_real_tree_keeps_every_contract():
  out = _lint(ROOT)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "BROKEN" not in out.stdout


@pytest.mark.parametrize("module, imports, contract", [
  ("pallas_kernels/_probe.py", "from model import layers", "pallas_kernels import nothing of the project"),
  ("model/_probe.py", "from training import train_step", "experiments -> rl -> serving"),
  ("serving/_probe.py", "import rl", "serving never imports rl"),
  ("training/_probe.py", "import experiments.param_count", "nothing imports experiments"),
  ("sharding/_probe.py", "from model import layers", "sharding imports nothing above it"),
  ("configs/_probe.py", "import model.config", "configs hold data"),
])
def test_a_broken_contract_fails(tmp_path, module, imports, contract):
  _copy_tree(tmp_path)
  (tmp_path / module).write_text(f'"""Offending module written by the layering test."""\n\n{imports}\n')
  out = _lint(tmp_path)
  assert out.returncode != 0, out.stdout
  broken = [line for line in out.stdout.splitlines() if "BROKEN" in line]
  assert any(contract in line for line in broken), out.stdout
