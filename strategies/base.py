"""The round protocol every fedcond strategy shares, with hooks for what differs between methods.

A method's strategy subclasses ``FedcondStrategy`` and overrides only what differs (as FL-bench's
Ditto server does): which parameters each client receives and how returned models are combined.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from flwr.common import EvaluateIns, EvaluateRes, FitIns, FitRes, Parameters, Scalar, ndarrays_to_parameters
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from fedcond.aggregation import Model
from fedcond.checkpoint import GLOBAL_MODEL, Checkpoint
from fedcond.config import Option, RunConfig
from fedcond.fingerprint import fingerprint_size
from fedcond.history import RunRecorder
from fedcond.messages import FINGERPRINT_MEAN, FINGERPRINT_STD, SERVER_ROUND, array_to_bytes
from fedcond.models import build_run_model, get_weights
from fedcond.participation import EVALUATE, FIT, NODE_LEFT, RoundParticipation
from strategies.accounting import (
    MIN_ANSWERED_FRACTION,
    Failures,
    RoundTracker,
    answered_replies,
    parameters_bytes,
)
from strategies.federation import ROUND_TIMEOUT, all_clients, federated_fingerprint_statistics, message_timeout
from strategies.membership import Membership, PartitionProxy

Instruction = TypeVar("Instruction", FitIns, EvaluateIns)
EMPTY = Parameters(tensors=[], tensor_type="numpy.ndarray")


@dataclass(frozen=True)
class StrategyInputs:
    """What the ServerApp gives a method's strategy to be built from."""

    config: RunConfig
    num_classes: int
    conditioned: bool
    recorder: RunRecorder | None
    #: The checkpoint a resumed run continues from (None: a new run, from round 1).
    resume: Checkpoint | None = None


def initial_weights(inputs: StrategyInputs, seed: int | None = None) -> Model:
    """The seeded initial backbone (conditioned or not), as every client builds it; ``seed``
    defaults to the run's."""
    return get_weights(build_run_model(inputs.config, inputs.num_classes, inputs.conditioned, seed))


class FedcondStrategy(Strategy):
    """Every client trains and evaluates in every round; the history records each round.

    Subclasses say which parameters each client receives (``fit_parameters``,
    ``evaluate_parameters``) and how returned models are combined (``combine``); a client is its
    partition id throughout (``strategies.membership``), never Flower's node id. Before round 1 the
    strategy checks that one node per client is connected, asks each node which partition it holds
    and, for conditioned methods with ``normalisation = "federated"``, runs the secure sum of
    fingerprint statistics.

    Failures (``fedcond.participation``): each round asks every expected partition; a partition
    whose node is not connected fails ("node left"), as does a client that reports an error or
    raises; one that does not answer within ``round-timeout`` times out. ``combine`` sees only the
    clients that answered (weights renormalised over them), evaluation metrics are over the clients
    that answered evaluate, and when fewer clients can answer than ``min-answered-fraction`` (and
    ``answer_floor``) require, the run stops with one line. A client that failed is asked again the
    next round.

    After every round the ServerApp saves ``state()`` into the run's checkpoint; a resumed run calls
    ``load_state`` before its first round instead of setting up afresh (no secure sum: the published
    statistics are part of the state). Per-client state is saved by partition id, the one name a
    client keeps across runs (Flower's node ids are new in every run).

    Held-out clients (``held-out-clients`` per cluster, partition ids after the training clients)
    are never asked to train: they only evaluate, each round, the model a method would give them,
    and their accuracy is recorded apart (``heldout_accuracy``). They do not take part in the secure
    sum: they stand for clients that join after the federation was set up, so nothing the training
    clients see may depend on their data; they receive the published mean and standard deviation.
    """

    #: Peer-to-peer methods simulate exchanges between clients: server transfers are not counted.
    peer_to_peer: ClassVar[bool] = False
    #: Whether a held-out client (one that never trains) has a model to evaluate under this strategy:
    #: only where the server holds a model a newcomer would be given.
    serves_held_out_clients: ClassVar[bool] = False
    #: Run-config settings of this strategy, declared here rather than in a central list.
    options: ClassVar[tuple[Option, ...]] = ()
    #: Settings of the round protocol every strategy shares (failure policy, time limits).
    protocol_options: ClassVar[tuple[Option, ...]] = (MIN_ANSWERED_FRACTION, ROUND_TIMEOUT)

    def __init__(self, inputs: StrategyInputs) -> None:
        self.inputs = inputs
        config = inputs.config
        self.tracker = RoundTracker(inputs.recorder, config.num_server_rounds, config.verbose)
        self.shared_config: dict[str, Scalar] = {}
        self.secure_sum_bytes = 0
        self.membership = Membership(config.num_clients, message_timeout(config), inputs.recorder, config.verbose)
        self.participation = RoundParticipation(0, ())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(method={self.inputs.config.method})"

    @property
    def training_partitions(self) -> range:
        return range(self.inputs.config.num_training_clients)

    # -- hooks ---------------------------------------------------------------------------------------
    def on_start(self) -> None:
        """Called once before round 1, when ``self.membership`` knows every client."""

    def initial_global(self) -> Parameters:
        """The global model Flower passes around (empty when the method has none)."""
        return EMPTY

    def fit_parameters(self, partition_id: int, current: Parameters) -> Parameters:
        return current

    def evaluate_parameters(self, partition_id: int, current: Parameters) -> Parameters:
        return current

    def combine(self, server_round: int, results: list[tuple[int, FitRes]]) -> Parameters | None:
        """The new global parameters from the answers of the clients that answered, as (partition id,
        reply) in partition order (None: keep the current ones)."""
        return None

    def answer_floor(self) -> int:
        """The fewest clients that must answer a round, whatever ``min-answered-fraction`` says."""
        return 1

    def state(self) -> tuple[dict[str, Model], dict[str, Any]]:
        """What the next round needs beyond the global model: named models and plain values.

        Subclasses that hold more extend both (per-client entries keyed by partition id).
        """
        return {}, {"shared_config": dict(self.shared_config), "secure_sum_bytes": self.secure_sum_bytes}

    def load_state(self, models: dict[str, Model], values: dict[str, Any]) -> None:
        """Take back what ``state`` saved (called after ``on_start``, whose set-up it replaces)."""
        self.shared_config = dict(values["shared_config"])
        self.secure_sum_bytes = int(values["secure_sum_bytes"])

    # -- Flower's Strategy API -------------------------------------------------------------------------
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        config = self.inputs.config
        self.membership.start(all_clients(client_manager, config))
        resume = self.inputs.resume
        if resume is None and self.inputs.conditioned and config.normalisation == "federated":
            size = fingerprint_size(
                config.fingerprint, config.fingerprint_dim, self.inputs.num_classes, config.num_clusters
            )
            training = [self.membership.node_of[partition] for partition in self.training_partitions]
            mean, std, self.secure_sum_bytes = federated_fingerprint_statistics(training, size, message_timeout(config))
            self.shared_config = {FINGERPRINT_MEAN: array_to_bytes(mean), FINGERPRINT_STD: array_to_bytes(std)}
        self.on_start()
        if resume is None:
            return self.initial_global()
        self.load_state(resume.models, resume.values)
        self.tracker.resume_after(resume.history)
        if GLOBAL_MODEL in resume.models:
            return ndarrays_to_parameters(resume.models[GLOBAL_MODEL])
        return EMPTY

    def round_config(self, server_round: int) -> dict[str, Scalar]:
        return {SERVER_ROUND: server_round, **self.shared_config}

    def instruct(
        self,
        stage: str,
        instruction: Callable[[Parameters, dict[str, Scalar]], Instruction],
        parameters_for: Callable[[int, Parameters], Parameters],
        partitions: Iterable[int],
        server_round: int,
        current: Parameters,
        client_manager: ClientManager,
    ) -> list[tuple[ClientProxy, Instruction]]:
        """One instruction per connected client of ``partitions`` (bytes counted); one asked but not
        connected fails ("node left"). Stops the run when too few are left to answer."""
        connected = self.membership.refresh(client_manager, server_round)
        config = self.round_config(server_round)
        instructions: list[tuple[ClientProxy, Instruction]] = []
        for partition in partitions:
            if partition not in connected:
                self.participation.fail(stage, partition, NODE_LEFT)
                continue
            proxy = PartitionProxy(connected[partition], partition, self.participation, stage)
            instructions.append((proxy, instruction(parameters_for(partition, current), config)))
        self.enforce_policy(stage, asking=True)
        if not self.peer_to_peer:
            self.tracker.sent(sum(parameters_bytes(ins.parameters) for _, ins in instructions))
        return instructions

    def enforce_policy(self, stage: str, asking: bool = False) -> None:
        """Report the round's new failures (terminal, ``run.json``); stop the run when too few
        clients are left to answer it."""
        failures = self.participation.new_failures()
        if failures and self.inputs.recorder is not None:
            self.inputs.recorder.add_events("failures", [failure.as_json() for failure in failures])
        if self.inputs.config.verbose:
            for failure in failures:
                print(f"fedcond: {failure.line()}", flush=True)
        self.participation.check(MIN_ANSWERED_FRACTION.of(self.inputs.config), self.answer_floor(), stage, asking)

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        self.tracker.start_round()
        # Every client is asked each round (held-out ones to evaluate only), whatever it did before.
        self.participation = RoundParticipation(server_round, range(self.inputs.config.num_clients))
        return self.instruct(
            FIT, FitIns, self.fit_parameters, self.training_partitions, server_round, parameters, client_manager
        )

    def aggregate_fit(
        self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures: Failures
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        answered = answered_replies(FIT, results, failures, self.participation)
        self.enforce_policy(FIT)
        self.tracker.received_fit(answered, count_bytes=not self.peer_to_peer)
        return self.combine(server_round, answered), {}

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        # Also the clients whose fit failed: their evaluation still says how the model serves them.
        everyone = range(self.inputs.config.num_clients)
        return self.instruct(
            EVALUATE, EvaluateIns, self.evaluate_parameters, everyone, server_round, parameters, client_manager
        )

    def aggregate_evaluate(
        self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]], failures: Failures
    ) -> tuple[float | None, dict[str, Scalar]]:
        answered = answered_replies(EVALUATE, results, failures, self.participation)
        self.enforce_policy(EVALUATE)
        training = self.inputs.config.num_training_clients
        held_out = [pair for pair in answered if pair[0] >= training]
        participating = [pair for pair in answered if pair[0] < training]
        record = self.tracker.finish_round(server_round, participating, held_out, self.participation.counts())
        return record.loss, {"accuracy": record.accuracy}

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        """No server-side evaluation: every client evaluates on its own test set."""
        return None
