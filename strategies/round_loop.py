"""Flower's own round loop, saving the run's checkpoint after rounds (``checkpoint_due``) and numbering rounds on
from the last finished one when a run is resumed; with secure aggregation, SecAgg+'s fit step."""

from __future__ import annotations

import statistics
import time
from typing import Any

from flwr.common import Parameters, Scalar, parameters_to_ndarrays
from flwr.server import Server, SimpleClientManager

from fedcond.checkpoint import CHECKPOINT_FILE, GLOBAL_MODEL, Checkpoint, checkpoint_due, save_checkpoint
from fedcond.errors import FedcondError
from fedcond.history import RunRecorder
from strategies.base import FedcondStrategy
from strategies.client_dp import ClientSideClientDp, ServerSideClientDp


class CheckpointingServer(Server):
    """``flwr.server.Server`` whose rounds are numbered after ``rounds_before`` (those a resumed run
    finished before) and which replaces the run's checkpoint after each round's evaluation.

    Flower's ``Server.fit`` loop runs unchanged (``num_rounds`` = the rounds still to go): only the
    number each round passes to the strategy is shifted, so that clients see the real round (their
    batch order depends on it) and the history goes on where it stopped. Flower's own log still
    counts its loop from 1.

    With ``secure-aggregation = "secaggplus"`` each round's fit step is Flower's ``SecAggPlusWorkflow``
    instead of ``Server.fit_round`` (``secure_fit_round``), as ``DefaultWorkflow`` would run it with
    ``SecAggPlusWorkflow`` as its fit workflow; evaluation, checkpoints and history are unchanged.
    """

    def __init__(
        self,
        strategy: FedcondStrategy,
        recorder: RunRecorder,
        rounds_before: int = 0,
        served: FedcondStrategy | ClientSideClientDp | ServerSideClientDp | None = None,
    ) -> None:
        # ``served`` is what Flower's loop talks to: the strategy, or Flower's DP wrapper around it.
        super().__init__(client_manager=SimpleClientManager(), strategy=served or strategy)
        self.served = served or strategy
        self.fedcond_strategy = strategy
        # Fold each fit reply into the round's mean as it arrives, unless something needs every reply's
        # own model: Flower's DP wrappers clip or reweigh each one, and SecAgg+ has no plain replies.
        strategy.fold_fit_replies = (
            strategy.combines_the_mean and self.served is strategy and not strategy.secure.model_updates
        )
        self.recorder = recorder
        self.rounds_before = rounds_before
        self.checkpoint_bytes = 0
        self.checkpoint_seconds: list[float] = []

    def set_max_workers(self, max_workers: int | None) -> None:
        super().set_max_workers(max_workers)
        self.fedcond_strategy.max_workers = max_workers  # for messages a strategy sends itself

    def fit_round(self, server_round: int, timeout: float | None) -> Any:
        number = server_round + self.rounds_before
        if self.fedcond_strategy.secure.model_updates:
            return self.secure_fit_round(number)
        return super().fit_round(number, timeout)

    def secure_fit_round(self, number: int) -> tuple[Parameters | None, dict[str, Scalar], tuple[list, list]]:
        """One fit step through SecAgg+: the served strategy's instructions go out as the protocol's
        training messages; the strategy gets the protocol's outcome, never a client's reply (what
        ``Server.fit_round`` returns, with no per-client results)."""
        if not isinstance(self.served, FedcondStrategy | ClientSideClientDp):
            raise FedcondError("secure-aggregation=secaggplus cannot run with client-dp=server-side")
        strategy = self.fedcond_strategy
        instructions = self.served.configure_fit(number, self.parameters, self._client_manager)
        outcome = strategy.secure_sum(
            instructions, number, self._client_manager, "secure aggregation",  # type: ignore[arg-type]
            (strategy.secure.clipping_range, strategy.secure.quantization_range),
            float(strategy.inputs.largest_training_set),
        )  # fmt: skip
        return self.served.aggregate_secure_fit(number, outcome), {}, ([], [])

    def evaluate_round(self, server_round: int, timeout: float | None) -> Any:
        number = server_round + self.rounds_before
        result = super().evaluate_round(number, timeout)
        self.fedcond_strategy.end_round(number)
        if checkpoint_due(self.fedcond_strategy.inputs.config, number):
            self.save_checkpoint(number)  # only after the round's history row: an error above skips it
        return result

    def save_checkpoint(self, number: int) -> None:
        start = time.perf_counter()
        models, values = self.fedcond_strategy.state()
        if self.parameters.tensors:
            models[GLOBAL_MODEL] = parameters_to_ndarrays(self.parameters)
        checkpoint = Checkpoint(number, list(self.recorder.records), models, values)
        self.checkpoint_bytes = save_checkpoint(self.recorder.folder, checkpoint)
        self.fedcond_strategy.checkpoint_saved()
        self.checkpoint_seconds.append(time.perf_counter() - start)

    def checkpoint_cost(self) -> dict[str, Any]:
        """What ``run.json`` says of the checkpoint: its size, and the seconds one save cost."""
        return {
            "file": CHECKPOINT_FILE,
            "bytes": self.checkpoint_bytes,
            "seconds_per_save": statistics.fmean(self.checkpoint_seconds) if self.checkpoint_seconds else None,
        }
