"""Flower's simulation runtime with the ClientApps run in this process instead of on Ray actors.

Everything else is Flower's own: the ServerApp in its thread, the in-memory Grid and LinkState,
message lifetimes (a hang still times out), the Simulation Runtime's worker loop (a client's
exception still becomes an error reply), the ClientApp with every mod (SecAgg+, clipping, the
tests' faults) and each node's Context. Messages and contexts are pickled on the way in and out,
as Ray pickles them to its actors, so nothing the clients share by reference goes unnoticed.

Why: a Ray start, its actor pool and its shutdown cost 10-15 s per run alone and 25-60 s on a busy
2-core machine, against a second or two of training in a test. The tests marked ``ray`` keep the
real backend (virtual clients in processes of their own, ``fedcond.federation.client_app``'s thread rule, pickling
the ClientApp by value); every other simulation in the suite runs here (``tests/conftest.py``).

Flower 1.42's runtime builds its only backend as ``raybackend.RayBackend(config)`` at the start of
each simulation (``vce_api.start_vce``); ``install`` replaces that name for this process.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import TypeVar

from flwr.clientapp.client_app import ClientApp, ClientAppException
from flwr.common import Context, Message
from flwr.server.superlink.fleet.vce.backend import Backend, BackendConfig, raybackend

Copied = TypeVar("Copied")


def through_pickle(value: Copied) -> Copied:
    """What an actor would receive: a copy made the way Ray sends arguments and results."""
    return pickle.loads(pickle.dumps(value))


class ThreadBackend(Backend):
    """Runs each message's ClientApp in the runtime's worker thread.

    ``workers`` is how many messages are handled at once: one keeps runs deterministic (clients
    in threads share torch's global random state, where Ray's actors have one each); two let a
    hanging client wait out its lifetime while the others answer, as two actors would.
    """

    workers = 1

    def __init__(self, backend_config: BackendConfig) -> None:
        super().__init__(backend_config)
        self.app_fn: Callable[[], ClientApp] | None = None

    def build(self, app_fn: Callable[[], ClientApp]) -> None:
        self.app_fn = app_fn

    @property
    def num_workers(self) -> int:
        return self.workers

    def is_worker_idle(self) -> bool:
        return True

    def terminate(self) -> None:
        """Nothing to stop: no process was started."""

    def process_message(self, message: Message, context: Context) -> tuple[Message, Context]:
        if self.app_fn is None:
            raise ValueError("build() the backend before it processes messages")
        message, context = through_pickle(message), through_pickle(context)
        try:
            reply = self.app_fn()(message=message, context=context)
        except Exception as error:  # as Ray's actor reports a ClientApp that raised
            raise ClientAppException(str(error)) from error
        return through_pickle(reply), through_pickle(context)


def install(workers: int = 1, assign: Callable[[object, str, object], None] = setattr) -> None:
    """Make every later simulation of this process run its ClientApps here, ``workers`` messages at
    once; ``assign`` sets the two names (a test passes ``monkeypatch.setattr``, undone after it)."""
    assign(ThreadBackend, "workers", workers)
    assign(raybackend, "RayBackend", ThreadBackend)
