"""``fedcond compare`` with a pause at one moment, for tests/test_interrupt.py to send Ctrl+C there.

    python -m tests.interrupted_compare MOMENT COMPARE-ARGUMENTS...

MOMENT is where the compare waits, once, after writing ``$FEDCOND_TEST_PAUSES/<moment>`` (the test
waits for that file, then signals the whole process group):

``ray-start``
    inside ``ray.init``: Ray's GCS is up, its raylet not started yet (``services.start_raylet``);
    the wait ends with the signal's ``KeyboardInterrupt``.
``fit-2``
    partition 0's Ray worker, in its round-2 fit (a Flower mod), waits for ``signalled`` (written by
    the test after its signal) and then kills itself, as a signal that reached the worker would;
    this process meanwhile handles its signal ``SLOW_HANDLER`` seconds late, so that the dead
    worker is seen before the stop is requested (the race ``fedcond.stopping.settled`` is for).
``checkpoint-2``
    in the server thread, round 2's checkpoint written to its temporary file and not yet put in
    place; the wait ends once the stop is requested, and the write goes on. With
    ``$FEDCOND_TEST_PAUSE_RUN``, only in the run of that folder name.
``none``
    no pause: the plain command.

The first run of the compare that reaches the moment pauses there (``O_EXCL``: once per folder of
pauses); the runs after it, and the same command run again, do not.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import ray.cloudpickle
from flwr.app import Message
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import Context
from flwr.compat.common import recorddict_compat as compat

from fedcond.federation.messages import SERVER_ROUND

PAUSES = "FEDCOND_TEST_PAUSES"
PAUSE_RUN = "FEDCOND_TEST_PAUSE_RUN"
SIGNALLED = "signalled"
#: Seconds the compare's handler waits before it requests the stop (``fit-2`` only).
SLOW_HANDLER = 1.0
#: The longest any pause waits (a test that never signals still ends).
LONGEST = 180.0

# Ray's workers unpickle the ClientApp, this module's mod included: by value (tests/ is not on their path).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def first_to_reach(folder: Path, moment: str) -> bool:
    """Claim ``moment`` (its file, created exclusively): True for the first caller only."""
    try:
        os.close(os.open(folder / moment, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def wait_for(condition, seconds: float = LONGEST) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


@dataclass(frozen=True)
class DieInFit:
    """A Flower mod: partition ``partition_id``'s round-``server_round`` fit announces itself, waits for
    the test's signal and kills its own worker (SIGKILL: no clean-up, no reply)."""

    folder: str
    moment: str
    partition_id: int = 0
    server_round: int = 2

    def __call__(self, message: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if (
            int(context.node_config["partition-id"]) == self.partition_id
            and message.metadata.message_type == "train"
            and int(compat.recorddict_to_fitins(message.content, keep_input=True).config[SERVER_ROUND])
            == self.server_round
            and first_to_reach(Path(self.folder), self.moment)
        ):
            wait_for((Path(self.folder) / SIGNALLED).exists)
            os.kill(os.getpid(), signal.SIGKILL)
        return call_next(message, context)


def pause_in_ray_start(folder: Path) -> None:
    from ray._private import services

    start_raylet = services.start_raylet

    def paused(*args, **kwargs):  # type: ignore[no-untyped-def]
        if first_to_reach(folder, "ray-start"):
            wait_for(lambda: False)  # until the signal's KeyboardInterrupt
        return start_raylet(*args, **kwargs)

    services.start_raylet = paused


def die_in_fit(folder: Path) -> None:
    from fedcond import stopping
    from fedcond.tools import simulation

    make_client_app = simulation.make_client_app
    dies = DieInFit(str(folder), "fit-2")
    simulation.make_client_app = lambda config, mods=(): make_client_app(config, (*mods, dies))
    on_signal = stopping._on_signal

    def slow(signum: int, frame: object) -> None:
        time.sleep(SLOW_HANDLER)
        on_signal(signum, frame)

    stopping._on_signal = slow


def pause_in_checkpoint(folder: Path) -> None:
    import torch

    from fedcond import stopping
    from fedcond.records import checkpoint

    class WritingPaused:
        """``torch`` as the checkpoint module sees it: round 2's ``save`` waits, once, for the stop."""

        def __getattr__(self, name: str) -> object:
            return getattr(torch, name)

        def save(self, payload: dict, handle: object) -> None:  # type: ignore[type-arg]
            torch.save(payload, handle)
            run = Path(handle.name).parent.name  # type: ignore[attr-defined]
            paused_here = run == os.environ.get(PAUSE_RUN) or not os.environ.get(PAUSE_RUN)
            if payload["round"] == 2 and paused_here and first_to_reach(folder, "checkpoint-2"):
                wait_for(stopping.requested)

    checkpoint.torch = WritingPaused()  # type: ignore[assignment]


MOMENTS = {"ray-start": pause_in_ray_start, "fit-2": die_in_fit, "checkpoint-2": pause_in_checkpoint}


def main(arguments: list[str]) -> int:
    moment, *command = arguments
    if moment != "none":
        MOMENTS[moment](Path(os.environ[PAUSES]))
    from fedcond.tools.cli import main as fedcond

    return fedcond(command)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
