"""A stop under way (Ctrl+C, SIGTERM) and the rule it sets: from then on, the run records nothing.

``fedcond compare`` and ``sweep`` run each run's ServerApp in a thread of their process, its clients
on Ray's workers. A terminal's Ctrl+C sends SIGINT to the whole process group, Ray's processes
included; a scheduler or ``kill`` sends SIGTERM. The main thread handles the signal (``handlers``):
``request`` first sets a process-wide event, then the main thread shuts the run down (Ray's workers
die with it). The ServerApp thread learns of the stop here, before it records anything: a client
failure (``fedcond.federation.participation``), a history row or a ``run.json`` write (``fedcond.records.history``), a
checkpoint (``fedcond.records.checkpoint``) each go through ``check`` or ``committing`` and are refused
(``Interrupted``) once the event is set. The round under way is discarded; the run's folder keeps
what it held when the stop began and says ``stopped`` (``mark_stopped``); the same command resumes it
from its last checkpoint, to the history an uninterrupted run writes.

A client failure the client did not report itself (its Ray worker died, its message went unanswered)
may be seen a moment before the main thread has run its handler: a worker killed by the signal that
also reached this process. While the handlers are installed and the clients run in other processes
(``remote_clients``: Ray's workers), such a failure waits up to ``SETTLE_SECONDS`` for a stop
(``settled``) before it is recorded; one the client raised or reported is recorded at once, unless a
stop is already under way.

Ray 2.55 starts its processes with SIGINT blocked (``ray/_private/services.py``, inherited by the
workers raylet starts): Ctrl+C reaches only this process, which stops Ray itself. SIGTERM to the
group reaches Ray's processes too, whose own handlers end them: the case ``settled`` is for.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

#: Set by ``request``: a stop is under way in this process.
STOPPING = threading.Event()
#: Set with STOPPING when the stop came from SIGTERM (the exit status says so: 143, not 130).
SIGTERM_RECEIVED = threading.Event()
#: Held around every write a stop must not interleave with (``committing``, ``mark_stopped``).
_COMMIT = threading.RLock()
#: How long a failure the client did not report itself waits for a stop to be requested.
SETTLE_SECONDS = 3.0
_installed: list[dict[int, object]] = []
_remote: list[bool] = []


class Interrupted(KeyboardInterrupt):
    """Raised where a run would record something after a stop began (never caught as a failure:
    a ``KeyboardInterrupt``, which ``except Exception`` lets through)."""


def request(signum: int = signal.SIGINT) -> None:
    """A stop is under way: nothing is recorded from now on (the main thread then shuts the run down)."""
    if signum == signal.SIGTERM:
        SIGTERM_RECEIVED.set()
    STOPPING.set()


def requested() -> bool:
    return STOPPING.is_set()


def check(what: str) -> None:
    """Refuse ``what`` (raise ``Interrupted``) when a stop is under way."""
    if STOPPING.is_set():
        raise Interrupted(f"{what} not recorded: a stop (Ctrl+C or SIGTERM) is under way")


@contextlib.contextmanager
def committing(what: str) -> Iterator[None]:
    """The body writes ``what`` unless a stop is under way; ``mark_stopped`` waits for a write in
    progress, so no write lands after the run says ``stopped``."""
    with _COMMIT:
        check(what)
        yield


@contextlib.contextmanager
def commit_lock() -> Iterator[None]:
    """The lock ``committing`` holds, without its check: for writing that the run stopped."""
    with _COMMIT:
        yield


def watching() -> bool:
    """Whether this process's stop handlers are installed (a compare or sweep is running)."""
    return bool(_installed)


@contextlib.contextmanager
def remote_clients() -> Iterator[None]:
    """The body runs clients in processes a signal to the process group also reaches (Ray's workers)."""
    _remote.append(True)
    try:
        yield
    finally:
        _remote.pop()


def settled(what: str) -> None:
    """Before recording a failure the client did not report itself: refuse it (``Interrupted``) when a
    stop is under way, or, while the handlers are installed and the clients run in other processes,
    when one comes within ``SETTLE_SECONDS``: a Ray worker that the signal killed may be seen dead
    before this process's handler has run."""
    if watching() and _remote:
        STOPPING.wait(SETTLE_SECONDS)
    check(what)


def _on_signal(signum: int, frame: object) -> None:
    """The first Ctrl+C or SIGTERM: the stop is requested, then ``KeyboardInterrupt`` unwinds the main
    thread (shutting Ray down on its way); a further one is only noted (``quiet``)."""
    request(signum)
    quiet()
    raise KeyboardInterrupt


def _while_stopping(signum: int, frame: object) -> None:
    """A second Ctrl+C or SIGTERM while the first one's stop is under way: noted, never a second
    ``KeyboardInterrupt`` in the middle of shutting Ray down."""
    request(signum)


def install() -> None:
    """Put the handlers (back) in place while ``handlers`` is in force: SIGINT and SIGTERM request a
    stop and raise ``KeyboardInterrupt`` in the main thread. Called again after ``ray.init``, which puts
    Ray's own SIGTERM handler in place; nothing outside ``handlers`` (a test's simulation)."""
    if not _installed or threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _while_stopping if STOPPING.is_set() else _on_signal)


@contextlib.contextmanager
def handlers() -> Iterator[None]:
    """Ctrl+C and SIGTERM stop what runs in the body (``KeyboardInterrupt`` in the main thread), with
    ``request`` before anything else; the previous handlers are back afterwards. A new body starts
    with no stop under way (tests run several in one process)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    STOPPING.clear()
    SIGTERM_RECEIVED.clear()
    _installed.append({signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)})
    try:
        install()
        yield
    finally:
        for signum, previous in _installed.pop().items():
            signal.signal(signum, previous)  # type: ignore[arg-type]


def quiet() -> None:
    """A stop is under way, and from now on a further Ctrl+C or SIGTERM is noted only (the stop is being
    carried out: shutting Ray down, ending its processes)."""
    STOPPING.set()
    if _installed and threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _while_stopping)
