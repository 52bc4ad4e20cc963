"""The processes a local deployment starts, and stopping all of them, however deep, with psutil.

Flower's processes start others (a SuperLink its SuperExec, in a session of its own; a SuperNode a
ClientApp process per message), and some outlive their parents. Every started process carries a
tag in its environment, inherited by all it starts, so ``stop_all`` finds them even after they
were handed to init.

A launcher killed outright (``kill -9``: no clean-up runs in it) must not leave them running either:
``Processes.guard`` starts a small watcher, this module run as a script, that waits for the launcher's
end and then stops every process carrying its tag.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO

import psutil

# Environment variable marking every process one launcher started.
TAG_VARIABLE = "FEDCOND_DEPLOY_TAG"
STOP_GRACE = 15.0  # seconds between SIGTERM and SIGKILL: a SuperNode takes ~8 s to shut down
GUARD_POLL = 0.5  # seconds between the guard's looks at its launcher


def descendants(roots: Iterable[int]) -> set[int]:
    """Every live process below ``roots`` (pids)."""
    found: set[int] = set()
    for pid in roots:
        try:
            found |= {child.pid for child in psutil.Process(pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            continue
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def tagged(tag: str, variable: str = TAG_VARIABLE) -> set[int]:
    """Live processes whose environment carries ``variable=tag``."""
    found = set()
    for process in psutil.process_iter(["environ"], ad_value=None):
        environment = process.info["environ"] or {}
        if environment.get(variable) == tag and alive(process.pid):
            found.add(process.pid)
    return found


def _processes(pids: Iterable[int]) -> list[psutil.Process]:
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return found


def _send(processes: Iterable[psutil.Process], kill: bool) -> None:
    for process in processes:
        try:
            process.kill() if kill else process.terminate()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue


def end_processes(pids: Iterable[int], grace: float = STOP_GRACE) -> None:
    """SIGTERM ``pids``, then SIGKILL those still running after ``grace`` seconds."""
    family = _processes(pids)
    _send(family, kill=False)
    _, left = psutil.wait_procs(family, timeout=grace)
    _send(left, kill=True)


class Processes:
    """Every process the launcher starts, each in its own session, all stopped together."""

    def __init__(self, environment: dict[str, str], log_folder: Path, tag: str = "") -> None:
        # Every child inherits the tag, so stop_all finds processes started while it was stopping.
        # (``tag``: another launcher's, whose processes the guard stops once that launcher is gone.)
        self.tag = tag or uuid.uuid4().hex
        self.environment = {**environment, TAG_VARIABLE: self.tag}
        self.log_folder = log_folder
        self.started: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.guardian: subprocess.Popen[bytes] | None = None

    def guard(self) -> None:
        """From now on, should this process end without ``stop_all`` (``kill -9``), a watcher stops
        everything it started. The watcher carries no tag and runs in a session of its own (Ctrl+C
        does not reach it); ``stop_all`` ends it once it has nothing left to guard."""
        environment = {key: value for key, value in self.environment.items() if key != TAG_VARIABLE}
        self.guardian = subprocess.Popen(
            [sys.executable, "-m", __name__, str(os.getpid()), self.tag], env=environment,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip

    def start(
        self, name: str, command: Sequence[str], cwd: Path, log: bool = True, pipe: bool = False
    ) -> subprocess.Popen[bytes]:
        """Start ``command``; its output goes to ``<log folder>/<name>.log`` (else to ours, or with
        ``pipe`` to the process's ``stdout`` for the launcher to read, stderr included).

        A name started again (a restarted node) appends to its log: what the first one wrote stays.
        """
        output: IO[bytes] | int | None = self.log_path(name).open("ab") if log else None
        if pipe:
            output = subprocess.PIPE
        try:
            # A new session per process: Ctrl+C reaches only this launcher, which then stops them in order.
            process = subprocess.Popen(
                list(command), cwd=cwd, env=self.environment, stdout=output,
                stderr=subprocess.STDOUT if log or pipe else None, start_new_session=True,
            )  # fmt: skip
        finally:
            if output is not None and not isinstance(output, int):
                output.close()  # the child holds its own copy
        self.started.append((name, process))
        return process

    def log_path(self, name: str) -> Path:
        return self.log_folder / f"{name}.log"

    def stopped(self) -> list[str]:
        """Names of started processes that have exited (not counting those ``kill`` ended)."""
        return [name for name, process in self.started if process.poll() is not None]

    def running(self, name: str) -> subprocess.Popen[bytes] | None:
        """The live process started as ``name``, if any."""
        return next((process for known, process in self.started if known == name and process.poll() is None), None)

    def kill(self, name: str) -> None:
        """SIGKILL ``name`` and everything below it at once, as a machine that loses power: no clean-up
        runs, so no goodbye reaches anyone. Forgotten afterwards: ``stopped`` no longer lists it."""
        ended = [process for known, process in self.started if known == name]
        leaders = {process.pid for process in ended if process.poll() is None}
        family = _processes(leaders | descendants(leaders))
        _send(family, kill=True)
        for process in ended:
            process.wait(timeout=STOP_GRACE)
        deadline = time.monotonic() + STOP_GRACE
        while any(alive(process.pid) for process in family) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.started = [(known, process) for known, process in self.started if known != name]

    def stop_all(self) -> None:
        """SIGTERM every process and its descendants, SIGKILL what is left after ``STOP_GRACE``."""
        leaders = {process.pid for _, process in self.started if process.poll() is None}
        # Found before any parent exits and orphans its children.
        family = _processes(leaders | descendants(leaders) | tagged(self.tag))
        _send(family, kill=False)
        deadline = time.monotonic() + STOP_GRACE
        while time.monotonic() < deadline:
            for _, process in self.started:
                process.poll()  # reap our own children so they don't linger as zombies
            # A SuperNode may start a ClientApp process while shutting down: stop late arrivals too.
            late = _processes(tagged(self.tag) - {process.pid for process in family})
            _send(late, kill=False)
            family += late
            if not any(alive(process.pid) for process in family):
                break
            time.sleep(0.2)
        for _ in range(5):
            left = _processes({process.pid for process in family if alive(process.pid)} | tagged(self.tag))
            if not left:
                break
            _send(left, kill=True)
            time.sleep(0.2)
        for _, process in self.started:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                continue
        if self.guardian is not None:
            self.guardian.terminate()
            self.guardian.wait(timeout=STOP_GRACE)
            self.guardian = None


def watch_over(launcher: int, tag: str) -> None:
    """The guard: once ``launcher`` has ended, however it ended, stop every process tagged ``tag``."""
    while alive(launcher):
        time.sleep(GUARD_POLL)
    Processes({}, Path("."), tag).stop_all()


if __name__ == "__main__":
    watch_over(int(sys.argv[1]), sys.argv[2])
