"""Flower's own round loop, saving the run's checkpoint after every round and numbering rounds on
from the last finished one when a run is resumed."""

from __future__ import annotations

import statistics
import time
from typing import Any

from flwr.common import parameters_to_ndarrays
from flwr.server import Server, SimpleClientManager
from flwr.server.strategy import Strategy

from fedcond.checkpoint import CHECKPOINT_FILE, GLOBAL_MODEL, Checkpoint, save_checkpoint
from fedcond.history import RunRecorder
from strategies.base import FedcondStrategy


class CheckpointingServer(Server):
    """``flwr.server.Server`` whose rounds are numbered after ``rounds_before`` (those a resumed run
    finished before) and which replaces the run's checkpoint after each round's evaluation.

    Flower's ``Server.fit`` loop runs unchanged (``num_rounds`` = the rounds still to go): only the
    number each round passes to the strategy is shifted, so that clients see the real round (their
    batch order depends on it) and the history goes on where it stopped. Flower's own log still
    counts its loop from 1.
    """

    def __init__(
        self, strategy: FedcondStrategy, recorder: RunRecorder, rounds_before: int = 0, served: Strategy | None = None
    ) -> None:
        # ``served`` is what Flower's loop talks to: the strategy, or Flower's DP wrapper around it.
        super().__init__(client_manager=SimpleClientManager(), strategy=served or strategy)
        self.fedcond_strategy = strategy
        self.recorder = recorder
        self.rounds_before = rounds_before
        self.checkpoint_bytes = 0
        self.checkpoint_seconds: list[float] = []

    def fit_round(self, server_round: int, timeout: float | None) -> Any:
        return super().fit_round(server_round + self.rounds_before, timeout)

    def evaluate_round(self, server_round: int, timeout: float | None) -> Any:
        number = server_round + self.rounds_before
        result = super().evaluate_round(number, timeout)
        self.save_checkpoint(number)  # only after the round's history row: an error above skips it
        return result

    def save_checkpoint(self, number: int) -> None:
        start = time.perf_counter()
        models, values = self.fedcond_strategy.state()
        if self.parameters.tensors:
            models[GLOBAL_MODEL] = parameters_to_ndarrays(self.parameters)
        checkpoint = Checkpoint(number, list(self.recorder.records), models, values)
        self.checkpoint_bytes = save_checkpoint(self.recorder.folder, checkpoint)
        self.checkpoint_seconds.append(time.perf_counter() - start)

    def checkpoint_cost(self) -> dict[str, Any]:
        """What ``run.json`` says of the checkpoint: its size, and the seconds saving it cost a round."""
        return {
            "file": CHECKPOINT_FILE,
            "bytes": self.checkpoint_bytes,
            "seconds_per_round": statistics.fmean(self.checkpoint_seconds) if self.checkpoint_seconds else None,
        }
