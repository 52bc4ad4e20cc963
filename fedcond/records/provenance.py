"""Which code made a run: the commit of the checkout it ran from, and whether that code had changes
not committed (run.json's ``code``; the reports flag tables that mix commits or hold such runs).

Read once per process, when first asked: the modules a process runs are those it imported at its
start, so a commit made while a sweep runs must not relabel that sweep's later runs.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any

#: The paths whose changes change what a run computes (results, docs and tests do not).
CODE_PATHS = ("fedcond", "clients", "strategies", "pyproject.toml")
#: run.json's key.
CODE = "code"


def _git(checkout: Path, *arguments: str) -> str | None:
    try:
        result = subprocess.run(
            ["git", "-C", str(checkout), *arguments], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


@functools.cache
def code_version() -> dict[str, Any]:
    """This process's code: ``checkout_code`` of the checkout fedcond is imported from."""
    return checkout_code(Path(__file__).resolve().parents[2])


def checkout_code(checkout: Path) -> dict[str, Any]:
    """``commit`` (None where ``checkout`` is no git checkout's top: an install from a wheel) and
    ``dirty`` (uncommitted changes to ``CODE_PATHS``, None when unknown)."""
    top = _git(checkout, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != checkout:
        return {"commit": None, "dirty": None}
    commit = _git(checkout, "rev-parse", "HEAD")
    changes = _git(checkout, "status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS)
    return {"commit": commit, "dirty": None if changes is None else bool(changes)}


def describe(code: dict[str, Any] | None) -> str:
    """A run's code in a table's note: ``1a2b3c4``, ``1a2b3c4+changes``, or ``unknown``."""
    if not code or not code.get("commit"):
        return "unknown"
    return str(code["commit"])[:7] + ("+changes" if code.get("dirty") else "")
