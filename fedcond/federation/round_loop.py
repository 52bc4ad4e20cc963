"""The run's round loop: one round from start to end in ``CheckpointingServer.run_round``, on Flower's
message passing (``Server.fit_round`` / ``evaluate_round``); rounds numbered on from the last
finished one when a run is resumed, the checkpoint saved after rounds (``checkpoint_due``); with
secure aggregation, SecAgg+'s fit step."""

from __future__ import annotations

import statistics
import time
from typing import Any

from flwr.common import Parameters, Scalar, parameters_to_ndarrays
from flwr.server import Server, SimpleClientManager
from flwr.server.history import History

from fedcond import stopping
from fedcond.errors import FedcondError
from fedcond.federation.client_dp import ClientSideClientDp, ServerSideClientDp
from fedcond.federation.strategy import FedcondStrategy
from fedcond.records.checkpoint import CHECKPOINT_FILE, GLOBAL_MODEL, Checkpoint, checkpoint_due, save_checkpoint
from fedcond.records.history import RunRecorder


class CheckpointingServer(Server):
    """``flwr.server.Server`` whose loop (``fit``) runs ``run_round`` for the rounds still to go,
    numbered after ``rounds_before`` (those a resumed run finished before), so that clients see the
    real round (their batch order depends on it) and the history goes on where it stopped.

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
            strategy.method.combines_the_mean and self.served is strategy and not strategy.secure.model_updates
        )
        self.recorder = recorder
        self.rounds_before = rounds_before
        self.checkpoint_bytes = 0
        self.checkpoint_seconds: list[float] = []

    def set_max_workers(self, max_workers: int | None) -> None:
        super().set_max_workers(max_workers)
        self.fedcond_strategy.max_workers = max_workers  # for messages a strategy sends itself

    def fit(self, num_rounds: int, timeout: float | None) -> tuple[History, float]:
        """The run (what Flower's ``start_grid`` calls): the initial parameters, then each round."""
        history = History()
        self.parameters = self._get_initial_parameters(server_round=0, timeout=timeout)
        start = time.perf_counter()
        for number in range(self.rounds_before + 1, self.rounds_before + num_rounds + 1):
            self.run_round(number, timeout, history)
        return history, time.perf_counter() - start

    def run_round(self, number: int, timeout: float | None, history: History) -> None:
        """Round ``number`` from start to end; each step is one call of the served strategy (the
        method's ``FedcondStrategy``, or Flower's DP wrapper around it).

        1. Sample and instruct: ``configure_fit`` draws the round's clients (``clients-per-round``)
           and gives each its parameters and settings (the method's ``instruction``).
        2. Collect: Flower sends the instructions and waits for the replies (``fit_clients``), or,
           under secure aggregation, SecAgg+'s protocol returns only their sum.
        3. Failure policy, then combine: ``aggregate_fit`` applies the policy (``min-answered-fraction``
           and the time limits) and the method's ``combine`` makes the new global parameters.
        4. Evaluate: each client scores the new model on its own test set (``configure_evaluate``,
           ``aggregate_evaluate``). With ``evaluate-in-fit`` (one message per client per round)
           there is no evaluate message: the next round's instruction carries the model and its
           reply carries the score, so round r's scores arrive in round r + 1 and its record is
           completed there (``RoundTracker.complete_pending``, the one place that does it); the last
           round ends with an evaluate message.
        5. Record: ``end_round`` closes the round's history row (or leaves it pending, as above).
        6. Checkpoint: the strategy's state and the global model (``checkpoint-every``), only after
           the round's row, so that an error above leaves the last good checkpoint.

        A stop (Ctrl+C, SIGTERM: ``fedcond.stopping``) discards the round under way: from the moment it
        is requested no failure, row, ``run.json`` line or checkpoint is recorded (``Interrupted``).
        """
        stopping.check(f"round {number}")
        if self.fedcond_strategy.secure.model_updates:
            fitted = self.secure_fit_round(number)
        else:
            fitted = super().fit_round(number, timeout)
        if fitted is not None:
            parameters, fit_metrics, _ = fitted
            if parameters:
                self.parameters = parameters
            history.add_metrics_distributed_fit(server_round=number, metrics=fit_metrics)
        evaluated = super().evaluate_round(number, timeout)
        if evaluated is not None and evaluated[0] is not None:
            history.add_loss_distributed(server_round=number, loss=evaluated[0])
            history.add_metrics_distributed(server_round=number, metrics=evaluated[1])
        stopping.check(f"round {number}'s record")
        self.fedcond_strategy.end_round(number)
        if checkpoint_due(self.fedcond_strategy.inputs.config, number):
            self.save_checkpoint(number)

    def secure_fit_round(self, number: int) -> tuple[Parameters | None, dict[str, Scalar], tuple[list, list]]:
        """One fit step through SecAgg+: the served strategy's instructions go out as the protocol's
        training messages; the strategy gets the protocol's outcome, never a client's reply (what
        ``Server.fit_round`` returns, with no per-client results)."""
        if not isinstance(self.served, FedcondStrategy | ClientSideClientDp):
            raise FedcondError("secure-aggregation=secaggplus cannot run with client-dp=server-side")
        strategy = self.fedcond_strategy
        instructions = self.served.configure_fit(number, self.parameters, self._client_manager)
        outcome = strategy.secure_rounds.sum(
            instructions, number, self._client_manager, "secure aggregation",  # type: ignore[arg-type]
            (strategy.secure.clipping_range, strategy.secure.quantization_range),
            float(strategy.inputs.largest_training_set),
        )  # fmt: skip
        return self.served.aggregate_secure_fit(number, outcome), {}, ([], [])

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
