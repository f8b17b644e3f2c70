"""`make lint` reads every Python file the repository tracks: ruff's own list of the files it checks, against git's.

Fails for: a folder ruff leaves out by default (it skipped seg_train/dist/, whose name is in ruff's default
exclude, so 3 of 108 package files were never linted), an exclude added to the ruff config, or a tracked .py file
outside the folders `make lint` names.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes

ROOT = Path(__file__).resolve().parents[1]


def _lint_folders() -> list[str]:
    """The folders the Makefile's lint target passes to ruff."""
    text = (ROOT / "Makefile").read_text()
    found = re.search(r"^lint:.*\n\t.*ruff check (.+)$", text, re.M)
    assert found, "the Makefile has a lint target running ruff check"
    return found.group(1).split()


def test_ruff_checks_every_tracked_python_file():
    folders = _lint_folders()
    listed = subprocess.run([sys.executable, "-m", "ruff", "check", "--show-files", *folders], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    checked = {Path(p).resolve().relative_to(ROOT).as_posix() for p in listed if p.endswith(".py")}
    tracked = set(subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.split())
    assert len(tracked) > 150  # the listing read the repository
    assert not tracked - checked, f"tracked Python files ruff does not check: {sorted(tracked - checked)}"
