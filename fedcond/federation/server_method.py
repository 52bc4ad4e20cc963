"""What a method's server does differently: the hooks the round protocol (``fedcond.federation.strategy``)
calls, and the facts it reads about the method.

A method's strategy module (``strategies/<method>.py``) subclasses ``ServerMethod`` (or a family base:
``ClusterModels``, ``PeerToPeer``, FedAvg's) and fills only the hooks that differ, as FL-bench's Ditto
server does; ``FedcondStrategy``, the Flower strategy every method shares, is composed with one
``ServerMethod`` and runs the rounds. What a method may use of the protocol (the round's record,
the membership, the failures of the round, a secure sum) it reaches through ``self.protocol``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from flwr.common import FitRes, Parameters, Scalar
from flwr.server.client_manager import ClientManager
from flwr.serverapp.grid import Grid

from fedcond.config import Option, RunConfig
from fedcond.data.scenarios import Scenario
from fedcond.errors import FedcondError
from fedcond.federation.membership import Membership
from fedcond.federation.participation import RoundParticipation
from fedcond.federation.round_record import FoldedReplies, RoundTracker
from fedcond.federation.secagg_workflow import SecureRounds
from fedcond.model.aggregation import Model
from fedcond.model.networks import build_run_model, get_weights
from fedcond.records.checkpoint import Checkpoint
from fedcond.records.history import RunRecorder

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
    #: The run's scenario as the server builds it: where the ground truth lives (each partition's
    #: true cluster, for per-cluster accuracies, Oracle's models and IFCA's ARI) and how many samples
    #: the largest training client holds (SecAgg+'s largest weight).
    scenario: Scenario | None = None
    #: The run's grid, for the SecAgg+ workflow (the fingerprint statistics, secure model updates).
    grid: Grid | None = None

    @property
    def known_scenario(self) -> Scenario:
        if self.scenario is None:
            raise FedcondError("the strategy was built without the run's scenario; the ServerApp passes it")
        return self.scenario

    @property
    def true_clusters(self) -> tuple[int, ...]:
        """Partition id -> its true cluster, from the server's scenario (no client sends it)."""
        return tuple(client.cluster for client in self.known_scenario.clients)

    def training_samples(self, partition_id: int) -> int:
        """The training samples of ``partition_id``'s client, from the server's scenario."""
        return len(self.known_scenario.clients[partition_id].train_indices)

    @property
    def largest_training_set(self) -> int:
        return max(len(client.train_indices) for client in self.known_scenario.clients if not client.held_out)

    def grid_for(self, purpose: str) -> Grid:
        if self.grid is None:
            raise FedcondError(f"{purpose} needs the run's grid; the ServerApp passes it")
        return self.grid


def initial_weights(inputs: StrategyInputs, seed: int | None = None) -> Model:
    """The seeded initial backbone (conditioned or not), as every client builds it; ``seed``
    defaults to the run's."""
    return get_weights(build_run_model(inputs.config, inputs.num_classes, inputs.conditioned, seed))


class RoundServices(Protocol):
    """What a method may use of the round protocol it is composed with (``FedcondStrategy``)."""

    #: The round's record: bytes, training loss, ARI, failures reported.
    tracker: RoundTracker
    #: Which node holds which partition, refreshed each round.
    membership: Membership
    #: Who the round asked and who failed.
    participation: RoundParticipation
    #: Settings every instruction carries beyond the round number (the published fingerprint statistics).
    shared_config: dict[str, Scalar]
    #: The bytes of the set-up's secure sums (``run.json``).
    secure_sum_bytes: int
    #: This run's SecAgg+ sums.
    secure_rounds: SecureRounds
    #: The round's fit replies folded into their mean as they came (``combines_the_mean``).
    folded: FoldedReplies
    #: The round loop's thread limit, for messages a method sends itself.
    max_workers: int | None

    def round_config(self, server_round: int, stage: str = ...) -> dict[str, Scalar]: ...


class ServerMethod:
    """A method's server: the hooks the round protocol calls, each a no-op or FedAvg's rule here.

    ``check`` (its settings, before anything starts), ``set_up`` (a new run's exchange before round 1),
    ``initial_global``, ``start_round`` (before the round's instructions), ``instruction`` (what each
    client is sent, parameters and settings together), ``combine`` / ``combine_sum`` (the new global
    parameters from the replies, or from SecAgg+'s mean), ``before_evaluation`` (an exchange of its own
    before the round's evaluation), ``state`` / ``load_state`` (what the checkpoint keeps beyond the
    global model and the protocol's own), and the small ones: ``answer_floor``, ``divergence_fix``,
    ``checkpoint_saved``, ``reply_extra_shapes``. A client is its partition id throughout
    (``fedcond.federation.membership``), never Flower's node id.

    The protocol does for every method what none may forget: sampling, the failure policy, the
    history, evaluate-in-fit, byte counts, the checkpoint of its own state (and of this one's
    ``state``), held-out clients asked to evaluate only, the secure sums.
    """

    #: Peer-to-peer methods simulate exchanges between clients: server transfers are not counted.
    peer_to_peer: ClassVar[bool] = False
    #: Whether a held-out client (one that never trains) has a model to evaluate under this method:
    #: only where the server holds a model a newcomer would be given.
    serves_held_out_clients: ClassVar[bool] = False
    #: Whether the server is told the true clusters (Oracle): refused where a scenario has none.
    uses_true_clusters: ClassVar[bool] = False
    #: Run-config settings of this method's server, declared here rather than in a central list.
    options: ClassVar[tuple[Option, ...]] = ()
    #: Why this method's server cannot work from the sum of the returned models alone, as
    #: ``check_run`` words its refusal of secure-aggregation (None: it can, see ``combine_sum``).
    secure_aggregation_refusal: ClassVar[str | None] = "its server needs each client's own model, not their sum"
    #: Whether ``combine`` needs only the sample-weighted mean of the returned models, so that each
    #: reply can be folded into it as it arrives (``fedcond.federation.round_record.FoldedReplies``).
    combines_the_mean: ClassVar[bool] = False
    #: The named models of a fit reply (``fedcond.federation.messages.pack_parts``) where it carries more than
    #: the trained model (SCAFFOLD's model and control change); empty: the model alone.
    reply_parts: ClassVar[tuple[str, ...]] = ()
    #: Why this method's server has no average of a model for FedAvgM to step, as ``check_run`` words
    #: its refusal of ``server-momentum`` and ``server-learning-rate`` (None: it has one and steps it,
    #: ``fedcond.model.server_optimiser``).
    server_step_refusal: ClassVar[str | None] = "its server averages no model"
    #: Whether each client's update is one model that the server averages into one global model:
    #: what Flower's client-level DP wrappers clip and noise (``fedcond/federation/client_dp.py``).
    averages_one_model: ClassVar[bool] = False
    #: Whether the server averages one model per group of clients that it fixes without their data
    #: (Oracle's true clusters), each client in one group: client-level DP then clips each update
    #: against the model its client received and noises each group's mean as its own release
    #: (``fedcond/federation/client_dp.py``, ``PerModelClientDp``).
    client_dp_per_model: ClassVar[bool] = False

    #: The round protocol this method is composed with (set by ``FedcondStrategy``, before round 1).
    protocol: RoundServices

    def __init__(self, inputs: StrategyInputs) -> None:
        self.inputs = inputs
        #: The clients that train (partition ids); held-out clients come after them.
        self.training_partitions = range(inputs.config.num_training_clients)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(method={self.inputs.config.method})"

    @classmethod
    def check(cls, config: RunConfig) -> None:
        """A method's own checks of the run's settings, before anything starts (``check_run``)."""

    @classmethod
    def released_sums(cls, config: RunConfig) -> int:
        """How many one-off sums of every client's statistics ``set_up`` publishes (none here): under
        client-level DP each is clipped, noised and accounted (``fedcond/federation/client_dp.py``)."""
        return 0

    def set_up(self, client_manager: ClientManager) -> None:
        """A new run's exchange with the clients before round 1, once the membership step knows every
        client (a resumed run has its outcome in ``state`` instead): nothing here (``ConditionalFedAvg``
        sums the fingerprint statistics). What needs no client is set in ``__init__``."""

    def initial_global(self) -> Parameters:
        """The global model Flower passes around (empty when the method has none)."""
        return EMPTY

    def start_round(self, server_round: int) -> None:
        """Before the round's instructions are made: nothing here (Oracle follows a drifting client)."""

    def instruction(
        self, stage: str, partition_id: int, current: Parameters, config: dict[str, Scalar]
    ) -> tuple[Parameters, dict[str, Scalar]]:
        """What ``partition_id`` is sent at ``stage`` (``FIT`` or ``EVALUATE``): the parameters, and the
        round's settings with whatever a method's client needs to read those parameters (SCAFFOLD's
        part names, CFL's tree, pFedHN's adapted embedding): one hook, so the two cannot disagree.
        Here: the global model ``current``, the round's settings."""
        return current, config

    def combine(self, server_round: int, results: list[tuple[int, FitRes]]) -> Parameters | None:
        """The new global parameters from the answers of the clients that answered, as (partition id,
        reply) in partition order (None: keep the current ones)."""
        return None

    def combine_sum(self, server_round: int, mean: Model) -> Parameters | None:
        """Under SecAgg+: the new global parameters from the sample-weighted mean of the returned
        models, all the server learns (only methods whose ``secure_aggregation_refusal`` is None)."""
        raise FedcondError(f"secure-aggregation=secaggplus cannot serve this method: {self.secure_aggregation_refusal}")

    def before_evaluation(self, server_round: int, client_manager: ClientManager) -> None:
        """Before the round's evaluation instructions: nothing here (pFedHN's newcomers learn their
        embeddings)."""

    def reply_extra_shapes(self) -> list[tuple[int, ...]]:
        """The shapes of the arrays a fit reply carries after its model (or each named part), in
        order: none here (``head-fit=ridge``: the Gram matrix, ``strategies/conditional.py``)."""
        return []

    def answer_floor(self) -> int:
        """The fewest clients that must answer a round, whatever ``min-answered-fraction`` says."""
        return 1

    def divergence_fix(self) -> str:
        """What to change when training diverges: the clients' learning rate, unless a method's own
        server step is the likelier cause (pFedHN's)."""
        return f"lower learning-rate (now {self.inputs.config.learning_rate:g})"

    def state(self) -> tuple[dict[str, Model], dict[str, Any]]:
        """What the next round needs of this method beyond the global model: named models and plain
        values (per-client entries keyed by partition id); the protocol saves its own beside them."""
        return {}, {}

    def load_state(self, models: dict[str, Model], values: dict[str, Any]) -> None:
        """Take back what ``state`` saved (a resumed run, in place of ``set_up``)."""

    def checkpoint_saved(self) -> None:
        """Called once the checkpoint holding ``state`` is on disk: what an older one needed may go."""
