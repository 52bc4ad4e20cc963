"""The round protocol every fedcond strategy shares, with hooks for what differs between methods.

A method's strategy subclasses ``FedcondStrategy`` and overrides only what differs (as FL-bench's
Ditto server does): which parameters each client receives and how returned models are combined.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from flwr.common import EvaluateIns, EvaluateRes, FitIns, FitRes, Parameters, Scalar, ndarrays_to_parameters
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from fedcond.aggregation import Model
from fedcond.checkpoint import GLOBAL_MODEL, Checkpoint
from fedcond.config import Option, RunConfig
from fedcond.errors import FedcondError
from fedcond.fingerprint import fingerprint_size
from fedcond.history import RunRecorder
from fedcond.messages import (
    FINGERPRINT_MEAN,
    FINGERPRINT_STD,
    PARTITION_ID,
    SERVER_ROUND,
    STEP,
    STEP_IDENTITY,
    array_to_bytes,
)
from fedcond.models import build_run_model, get_weights
from strategies.accounting import Failures, RoundTracker, by_partition, parameters_bytes, raise_on_failures
from strategies.federation import all_clients, ask_all, federated_fingerprint_statistics

Instruction = TypeVar("Instruction", FitIns, EvaluateIns)
T = TypeVar("T")
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
    ``evaluate_parameters``) and how returned models are combined (``combine``). Before round 1 the
    strategy checks that one node per client is connected and, for conditioned methods with
    ``normalisation = "federated"``, runs the secure sum of fingerprint statistics.

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

    def __init__(self, inputs: StrategyInputs) -> None:
        self.inputs = inputs
        self.tracker = RoundTracker(inputs.recorder, inputs.config.num_server_rounds, inputs.config.verbose)
        self.shared_config: dict[str, Scalar] = {}
        self.secure_sum_bytes = 0
        self.held_out_cids: set[str] = set()
        # Every node's answer to the identity question before round 1 (partition id, true cluster).
        self.identities: dict[str, dict[str, Scalar]] = {}
        self.partition_of: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(method={self.inputs.config.method})"

    # -- hooks ---------------------------------------------------------------------------------------
    def on_start(self, proxies: list[ClientProxy]) -> None:
        """Called once before round 1 with every client."""

    def initial_global(self) -> Parameters:
        """The global model Flower passes around (empty when the method has none)."""
        return EMPTY

    def fit_parameters(self, proxy: ClientProxy, current: Parameters) -> Parameters:
        return current

    def evaluate_parameters(self, proxy: ClientProxy, current: Parameters) -> Parameters:
        return current

    def combine(self, server_round: int, results: list[tuple[ClientProxy, FitRes]]) -> Parameters | None:
        """The new global parameters from the round's results (None: keep the current ones)."""
        return None

    def state(self) -> tuple[dict[str, Model], dict[str, Any]]:
        """What the next round needs beyond the global model: named models and plain values.

        Subclasses that hold more extend both (per-client entries keyed by partition id).
        """
        return {}, {"shared_config": dict(self.shared_config), "secure_sum_bytes": self.secure_sum_bytes}

    def load_state(self, models: dict[str, Model], values: dict[str, Any]) -> None:
        """Take back what ``state`` saved (called after ``on_start``, whose set-up it replaces)."""
        self.shared_config = dict(values["shared_config"])
        self.secure_sum_bytes = int(values["secure_sum_bytes"])

    # -- per-client state under the name that survives a restart: the partition id -------------------
    def keyed_by_partition(self, per_node: dict[str, T]) -> dict[int, T]:
        return {self.partition_of[cid]: value for cid, value in per_node.items()}

    def keyed_by_node(self, per_partition: dict[int, T]) -> dict[str, T]:
        """``per_partition`` keyed by this run's node ids; a partition no node holds is an error."""
        node_of = {partition: cid for cid, partition in self.partition_of.items()}
        missing = sorted(set(per_partition) - set(node_of))
        if missing:
            raise FedcondError(
                f"the checkpoint holds state of partition(s) {missing} but no node of this federation has them; "
                "resume with the same nodes (num-clusters x clients-per-cluster, same partition ids)"
            )
        return {node_of[partition]: value for partition, value in per_partition.items()}

    # -- Flower's Strategy API -------------------------------------------------------------------------
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        config = self.inputs.config
        proxies = all_clients(client_manager, config)
        # Which node holds which partition: held-out clients are the last partition ids and must
        # never receive a training instruction, and state kept per client is saved by partition id.
        answers = ask_all(proxies, {STEP: STEP_IDENTITY})
        self.identities = {proxy.cid: answer for proxy, answer in zip(proxies, answers, strict=True)}
        self.partition_of = {cid: int(answer[PARTITION_ID]) for cid, answer in self.identities.items()}
        self.held_out_cids = {cid for cid, pid in self.partition_of.items() if pid >= config.num_training_clients}
        training = [proxy for proxy in proxies if proxy.cid not in self.held_out_cids]
        resume = self.inputs.resume
        if resume is None and self.inputs.conditioned and config.normalisation == "federated":
            size = fingerprint_size(
                config.fingerprint, config.fingerprint_dim, self.inputs.num_classes, config.num_clusters
            )
            mean, std, self.secure_sum_bytes = federated_fingerprint_statistics(training, size)
            self.shared_config = {FINGERPRINT_MEAN: array_to_bytes(mean), FINGERPRINT_STD: array_to_bytes(std)}
        self.on_start(proxies)
        if resume is None:
            return self.initial_global()
        self.load_state(resume.models, resume.values)
        self.tracker.resume_after(resume.history)
        if GLOBAL_MODEL in resume.models:
            return ndarrays_to_parameters(resume.models[GLOBAL_MODEL])
        return EMPTY

    def round_config(self, server_round: int) -> dict[str, Scalar]:
        return {SERVER_ROUND: server_round, **self.shared_config}

    def instruct_all(
        self,
        instruction: Callable[[Parameters, dict[str, Scalar]], Instruction],
        parameters_for: Callable[[ClientProxy, Parameters], Parameters],
        server_round: int,
        current: Parameters,
        client_manager: ClientManager,
        include_held_out: bool = True,
    ) -> list[tuple[ClientProxy, Instruction]]:
        """One instruction per client (every client takes part in every round), bytes counted."""
        config = self.round_config(server_round)
        instructions = [
            (proxy, instruction(parameters_for(proxy, current), config))
            for proxy in client_manager.all().values()
            if include_held_out or proxy.cid not in self.held_out_cids
        ]
        if not self.peer_to_peer:
            self.tracker.sent(sum(parameters_bytes(ins.parameters) for _, ins in instructions))
        return instructions

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        self.tracker.start_round()
        # Held-out clients never train: they receive evaluation instructions only.
        return self.instruct_all(
            FitIns, self.fit_parameters, server_round, parameters, client_manager, include_held_out=False
        )

    def aggregate_fit(
        self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures: Failures
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        raise_on_failures(failures, f"training round {server_round}", results)
        results = by_partition(results)
        self.tracker.received_fit(results, count_bytes=not self.peer_to_peer)
        return self.combine(server_round, results), {}

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        return self.instruct_all(EvaluateIns, self.evaluate_parameters, server_round, parameters, client_manager)

    def aggregate_evaluate(
        self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]], failures: Failures
    ) -> tuple[float | None, dict[str, Scalar]]:
        raise_on_failures(failures, f"evaluation round {server_round}", results)
        training = self.inputs.config.num_training_clients
        held_out = [pair for pair in results if int(pair[1].metrics[PARTITION_ID]) >= training]
        participating = [pair for pair in results if int(pair[1].metrics[PARTITION_ID]) < training]
        record = self.tracker.finish_round(server_round, participating, held_out)
        return record.loss, {"accuracy": record.accuracy}

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        """No server-side evaluation: every client evaluates on its own test set."""
        return None
