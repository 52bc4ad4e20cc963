"""Per-client models kept outside memory: where a federation of thousands of clients keeps them.

Two places hold one model per client, and at 10,000 clients neither fits in memory:

- **A client's own models** (Ditto's personal model, Local's model). A deployed SuperNode keeps them
  in ``context.state``, in its own process; a simulation keeps every virtual node's ``context.state``
  in the one simulation process (about 1.7 MB a client on MNIST). With ``client-state-dir`` set, each
  client writes them to its own files instead (``ClientModelFiles``): a folder per Flower run and
  partition, so nothing is shared between runs or clients. A resume is a new Flower run and starts
  them afresh, as with ``context.state``.
- **The server's copy of every client's model** that Gossip and DAC simulate the network with
  (``SpillingModels``): at most ``client-models-memory-mb`` of them stay in memory, the least
  recently used of the others are written to the run folder, one immutable file per client and
  round, which the checkpoint names instead of holding.
"""

from __future__ import annotations

import os
import shutil
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from fedcond.config import Option
from fedcond.errors import FedcondError

Model = list[np.ndarray]

CLIENT_STATE_DIR = Option(
    "client-state-dir",
    "",
    "folder where each client keeps what it holds between rounds (its own model, batch-norm layers or control "
    "variate; a subfolder per Flower run and partition) instead of Flower's in-memory context.state; for "
    "simulations of thousands of clients (a node config "
    "client-state-dir overrides it on that node)",
)
CLIENT_MODELS_MEMORY_MB = Option(
    "client-models-memory-mb",
    1024.0,
    "Gossip, DAC: megabytes of clients' models the server holds in memory; the rest go to files in the run "
    "folder (0: every one)",
    minimum=0,
)
#: Where the server's spilled client models go, inside the run folder.
SPILL_FOLDER = "client-models"
#: The checkpoint value naming each spilled client's file: partition id -> the round that wrote it.
SPILLED_VALUE = "spilled-client-models"
#: The checkpoint value giving the round each model held in memory came from (its file's name if spilled later).
HELD_ROUNDS_VALUE = "held-client-model-rounds"


def _write_atomically(path: Path, model: Model) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as handle:
        np.savez(handle, *model)
    os.replace(temporary, path)


def _read(path: Path) -> Model:
    with np.load(path) as stored:
        return [stored[f"arr_{index}"] for index in range(len(stored.files))]


def run_state_folder(base: str, run_id: int) -> Path:
    """The folder of one Flower run's client state under ``client-state-dir``."""
    return Path(base).expanduser() / f"run-{run_id}"


def remove_run_state(base: str, run_id: int) -> None:
    """Remove one finished run's client state, if this machine holds it (a simulation's does)."""
    if base:
        shutil.rmtree(run_state_folder(base, run_id), ignore_errors=True)


class ClientModelFiles:
    """One client's models of one Flower run, a file each (``<key>.npz``), written atomically."""

    def __init__(self, base: str, run_id: int, partition_id: int) -> None:
        self.folder = run_state_folder(base, run_id) / f"partition-{partition_id}"

    def get(self, key: str) -> Model | None:
        path = self.folder / f"{key}.npz"
        return _read(path) if path.exists() else None

    def put(self, key: str, model: Model) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            _write_atomically(self.folder / f"{key}.npz", model)
        except OSError as error:
            raise FedcondError(
                f"client-state-dir: cannot write {self.folder} ({error.strerror}); give a folder this node can write"
            ) from None


def model_bytes(model: Model) -> int:
    return sum(array.nbytes for array in model)


class SpillingModels:
    """Partition id -> that client's model, every client starting from ``initial``.

    At most ``memory_bytes`` of models stay in memory (least recently used first out); a model that
    leaves is written to ``folder`` as ``client-<id>-round-<r>.npz``, where r is the round that made
    it. Files are never rewritten with other contents, so a checkpoint can name them instead of
    holding them (``checkpoint_state``); a file no checkpoint needs any more is removed once the next
    one is saved (``checkpoint_saved``). Without a folder (a strategy built without a run folder)
    every model stays in memory.
    """

    def __init__(self, initial: Model, folder: Path | None, memory_bytes: int) -> None:
        self.initial = initial
        self.folder = folder
        self.memory_bytes = memory_bytes
        self.in_memory: OrderedDict[int, tuple[int, Model]] = OrderedDict()
        #: Partition id -> the round of its model's file, for clients whose model is only on disk.
        self.on_disk: dict[int, int] = {}
        #: Every file written and not yet removed, as (partition id, round).
        self.files: set[tuple[int, int]] = set()
        self.held_bytes = 0

    def path(self, partition_id: int, server_round: int) -> Path:
        assert self.folder is not None
        return self.folder / f"client-{partition_id}-round-{server_round}.npz"

    def __getitem__(self, partition_id: int) -> Model:
        if partition_id in self.in_memory:
            self.in_memory.move_to_end(partition_id)
            return self.in_memory[partition_id][1]
        if partition_id in self.on_disk:
            return _read(self.path(partition_id, self.on_disk[partition_id]))
        return self.initial

    def update(self, server_round: int, models: Iterable[tuple[int, Model]]) -> None:
        for partition_id, model in models:
            self._forget(partition_id)
            self.in_memory[partition_id] = (server_round, model)
            self.held_bytes += model_bytes(model)
        self._spill()

    def _forget(self, partition_id: int) -> None:
        self.on_disk.pop(partition_id, None)
        held = self.in_memory.pop(partition_id, None)
        if held is not None:
            self.held_bytes -= model_bytes(held[1])

    def _spill(self) -> None:
        if self.folder is None:
            return
        while self.held_bytes > self.memory_bytes and self.in_memory:
            partition_id, (server_round, model) = self.in_memory.popitem(last=False)
            self.held_bytes -= model_bytes(model)
            if (partition_id, server_round) not in self.files:
                self.folder.mkdir(parents=True, exist_ok=True)
                _write_atomically(self.path(partition_id, server_round), model)
                self.files.add((partition_id, server_round))
            self.on_disk[partition_id] = server_round

    def checkpoint_state(self) -> tuple[dict[int, Model], dict[str, Any]]:
        """The models in memory, and the files of the others (by partition id, the round that wrote each)."""
        held = {partition_id: model for partition_id, (_, model) in self.in_memory.items()}
        return held, {
            SPILLED_VALUE: {str(pid): server_round for pid, server_round in self.on_disk.items()},
            HELD_ROUNDS_VALUE: {str(pid): server_round for pid, (server_round, _) in self.in_memory.items()},
        }

    def checkpoint_saved(self) -> None:
        """Remove the files the checkpoint just saved no longer names."""
        needed = set(self.on_disk.items())
        for partition_id, server_round in sorted(self.files - needed):
            self.path(partition_id, server_round).unlink(missing_ok=True)
        self.files &= needed

    def load(self, held: dict[int, Model], values: dict[str, Any]) -> None:
        """The state a checkpoint recorded (``checkpoint_state``), from this run's own folder."""
        self.in_memory.clear()
        self.held_bytes = 0
        self.on_disk = {int(pid): int(server_round) for pid, server_round in values.get(SPILLED_VALUE, {}).items()}
        self.files = set(self.on_disk.items())
        rounds = {int(pid): int(server_round) for pid, server_round in values.get(HELD_ROUNDS_VALUE, {}).items()}
        for partition_id, model in held.items():
            self.in_memory[partition_id] = (rounds.get(partition_id, 0), model)
            self.held_bytes += model_bytes(model)
        self._spill()

    def __len__(self) -> int:
        return len(self.in_memory) + len(self.on_disk)
