"""Folder locks: one process at a time works in a compare/sweep ``--out`` folder or in a run's folder.

``flock`` rather than a PID file: the kernel releases the lock when its holder dies, however it dies,
so a stale lock is simply taken over, with no PID-reuse guesswork. The holder's PID is written into
the file only so that a refusal can name it.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import TextIO


class Held(Exception):
    """The lock is held by another process (``holder``: its PID as it wrote it, or ``unknown``)."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


def acquire(path: Path) -> TextIO:
    """Take the lock ``path`` (created if missing) for this process; ``Held`` if another holds it.

    The returned handle holds the lock until it is closed (or this process ends).
    """
    handle = path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise Held(holder) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def release(handle: TextIO) -> None:
    """Let go of the lock ``handle`` holds and remove its file: a folder nobody works in holds none.
    (Removed while still held: a process that opens the path afterwards makes a new lock of its own.)"""
    Path(handle.name).unlink(missing_ok=True)
    handle.close()


def holder_of(path: Path) -> str | None:
    """Who holds the lock ``path`` now (their PID), or None when nobody does (it is not taken)."""
    if not path.exists():
        return None
    try:
        release(acquire(path))  # free: a lock file left by a process that died goes too
    except Held as held:
        return held.holder
    return None
