"""The round protocol every fedcond strategy shares, with hooks for what differs between methods.

A method's strategy subclasses ``FedcondStrategy`` and overrides only what differs (as FL-bench's
Ditto server does): which parameters each client receives and how returned models are combined.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from flwr.common import (
    Code,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy
from flwr.serverapp.grid import Grid

from fedcond import stopping
from fedcond.config import Option, RunConfig
from fedcond.data.scenarios import Scenario, drift_partners_of
from fedcond.errors import FedcondError
from fedcond.federation.exchange import NODE_TIMEOUT, ROUND_TIMEOUT, all_clients, message_timeout
from fedcond.federation.membership import Membership, PartitionProxy
from fedcond.federation.messages import (
    ACCURACY,
    CLASS_CORRECT,
    CLASS_COUNT,
    ERROR,
    EVALUATE_FIRST,
    EVALUATED_ACCURACY,
    EVALUATED_EXAMPLES,
    EVALUATED_LOSS,
    INT64,
    SERVER_ROUND,
    VALIDATION_KEYS,
    array_from_bytes,
)
from fedcond.federation.participation import EVALUATE, FIT, NODE_LEFT, Failure, RoundParticipation
from fedcond.federation.round_record import (
    MIN_ANSWERED_FRACTION,
    Failures,
    RoundTracker,
    answered_replies,
    parameters_bytes,
)
from fedcond.federation.sampling import (
    CLIENTS_PER_ROUND,
    EVALUATE_EVERY,
    clients_per_round,
    evaluates_everyone,
    sample_partitions,
    scheduled_for_everyone,
)
from fedcond.federation.secagg_workflow import SecureSum, run_secure_sum, workflow_for
from fedcond.model.aggregation import Model, StreamingAverage
from fedcond.model.networks import build_run_model, get_weights
from fedcond.model.training import check_not_diverged
from fedcond.privacy.dp import SampleLevelPrivacy
from fedcond.privacy.secure_aggregation import SecureAggregation
from fedcond.records.checkpoint import GLOBAL_MODEL, Checkpoint
from fedcond.records.history import RoundRecord, RunRecorder, dataset_metric
from fedcond.records.metrics import class_accuracy

Instruction = TypeVar("Instruction", FitIns, EvaluateIns)

EVALUATE_IN_FIT = Option(
    "evaluate-in-fit",
    True,
    "one message per client per round: each training instruction also evaluates the model it brings (the last "
    "round's), the last round ends with one evaluate message; false: a fit and an evaluate message every round "
    "(the history is the same; under secure-aggregation the evaluate message stays, as the server sees no fit reply)",
)
EMPTY = Parameters(tensors=[], tensor_type="numpy.ndarray")
#: The tensor type of a fit reply whose model went into the round's running average on arrival.
FOLDED = "fedcond.folded"


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


def evaluations_in(fit_replies: list[tuple[int, FitRes]]) -> list[tuple[int, EvaluateRes]]:
    """The evaluations that fit replies carry (evaluate-in-fit), as the evaluate replies they replace."""
    return [
        (partition, EvaluateRes(res.status, float(res.metrics[EVALUATED_LOSS]), int(res.metrics[EVALUATED_EXAMPLES]),
                                {ACCURACY: res.metrics[EVALUATED_ACCURACY],
                                 **{key: res.metrics[key] for key in VALIDATION_KEYS if key in res.metrics}}))
        for partition, res in fit_replies
        if EVALUATED_LOSS in res.metrics
    ]  # fmt: skip


def initial_weights(inputs: StrategyInputs, seed: int | None = None) -> Model:
    """The seeded initial backbone (conditioned or not), as every client builds it; ``seed``
    defaults to the run's."""
    return get_weights(build_run_model(inputs.config, inputs.num_classes, inputs.conditioned, seed))


class FedcondStrategy(Strategy):
    """Each round's training clients (every one, or ``clients-per-round`` of them:
    ``fedcond.federation.sampling``) train and are evaluated; the history records each round.

    A method overrides only its hooks (the rest is the round protocol every method shares):
    ``check`` (its settings, before anything starts), ``set_up`` (a new run's exchange before round 1),
    ``initial_global``, ``instruction`` (what each client is sent, parameters and settings together),
    ``combine`` / ``combine_sum`` (the new global parameters from the replies, or from SecAgg+'s
    mean), ``state`` / ``load_state`` (what the checkpoint keeps beyond the global model), and the
    small ones: ``answer_floor``, ``divergence_fix``, ``checkpoint_saved``. A client is its
    partition id throughout (``fedcond.federation.membership``), never Flower's node id. Before round 1 the
    strategy checks that one node per client is connected, asks each node which partition it holds
    and runs the method's own set-up exchange (``set_up``; the conditional method's secure sum of
    fingerprint statistics, ``strategies/conditional.py``).

    With ``secure-aggregation = "secaggplus"`` the fit step of every round is SecAgg+'s
    (``fedcond.federation.round_loop``): the strategy gives the instructions as always, but never sees a
    reply; ``aggregate_secure_fit`` gets the protocol's outcome (the sample-weighted mean of the
    contributors' models, who contributed, who dropped out and why) and ``combine_sum`` makes the
    new global model from the mean. A strategy that needs more than the sum says why in
    ``secure_aggregation_refusal``, and ``check_run`` refuses the combination.

    Failures (``fedcond.federation.participation``): each round asks every expected partition; a partition
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
    #: The round loop's thread limit (Flower's ``max_workers``), for messages a strategy sends itself.
    max_workers: int | None = None
    #: Whether the server is told the true clusters (Oracle): refused where a scenario has none.
    uses_true_clusters: ClassVar[bool] = False
    #: Run-config settings of this strategy, declared here rather than in a central list.
    options: ClassVar[tuple[Option, ...]] = ()
    #: Settings of the round protocol every strategy shares (failure policy, time limits).
    protocol_options: ClassVar[tuple[Option, ...]] = (
        NODE_TIMEOUT, MIN_ANSWERED_FRACTION, ROUND_TIMEOUT, EVALUATE_IN_FIT, CLIENTS_PER_ROUND, EVALUATE_EVERY,
    )  # fmt: skip
    #: Why this strategy's server cannot work from the sum of the returned models alone, as
    #: ``check_run`` words its refusal of secure-aggregation (None: it can, see ``combine_sum``).
    secure_aggregation_refusal: ClassVar[str | None] = "its server needs each client's own model, not their sum"
    #: Whether ``combine`` needs only the sample-weighted mean of the returned models, so that each
    #: reply can be folded into it as it arrives (``fold_fit_replies``).
    combines_the_mean: ClassVar[bool] = False
    #: The named models of a fit reply (``fedcond.federation.messages.pack_parts``) where it carries more than
    #: the trained model (SCAFFOLD's model and control change); empty: the model alone.
    reply_parts: ClassVar[tuple[str, ...]] = ()
    #: Why this strategy's server has no average of a model for FedAvgM to step, as ``check_run`` words
    #: its refusal of ``server-momentum`` and ``server-learning-rate`` (None: it has one and steps it,
    #: ``fedcond.model.server_optimiser``).
    server_step_refusal: ClassVar[str | None] = "its server averages no model"
    #: Whether each client's update is one model that the server averages into one global model:
    #: what Flower's client-level DP wrappers clip and noise (``fedcond/federation/client_dp.py``).
    averages_one_model: ClassVar[bool] = False

    def __init__(self, inputs: StrategyInputs) -> None:
        self.inputs = inputs
        config = inputs.config
        drifting = frozenset(drift_partners_of(config)) if config.drift_round else frozenset()
        self.tracker = RoundTracker(
            inputs.recorder, config.num_server_rounds, inputs.true_clusters, config.verbose, drifting,
            dataset_metric(config.dataset),
        )  # fmt: skip
        self.shared_config: dict[str, Scalar] = {}
        self.secure_sum_bytes = 0
        self.secure = SecureAggregation.of(config)
        self.membership = Membership(config.num_clients, message_timeout(config), inputs.recorder, config.verbose)
        self.participation = RoundParticipation(0, ())
        #: Set by the round loop (fedcond/federation/round_loop.py) where nothing needs each reply's own
        #: model: each fit reply is then folded into ``fit_stream`` as it arrives and the round keeps
        #: one running sum instead of every client's model (1,000 x 1.7 MB at 1,000 MNIST clients).
        self.fold_fit_replies = False
        self.fit_stream: StreamingAverage | None = None
        self._stream_lock = threading.Lock()
        # SecAgg+ hands the server no fit reply, only the sum: an evaluation cannot ride in one.
        # A drift run scores each round's model on the data the clients hold in that round (fedcond.data.drift).
        self.evaluates_in_fit = EVALUATE_IN_FIT.of(config) and not self.secure.model_updates and not config.drift_round
        #: This round's training clients (``fedcond.federation.sampling``).
        self.sampled: list[int] = list(self.training_partitions)
        #: The last round whose record was closed (``end_round``).
        self.closed_round = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(method={self.inputs.config.method})"

    @classmethod
    def check(cls, config: RunConfig) -> None:
        """A method's own checks of the run's settings, before anything starts (``check_run``)."""

    @property
    def training_partitions(self) -> range:
        return range(self.inputs.config.num_training_clients)

    # -- hooks ---------------------------------------------------------------------------------------
    def set_up(self, client_manager: ClientManager) -> None:
        """A new run's exchange with the clients before round 1, once the membership step knows every
        client (a resumed run has its outcome in ``state`` instead): nothing here (``ConditionalFedAvg``
        sums the fingerprint statistics). What needs no client is set in ``__init__``."""

    def initial_global(self) -> Parameters:
        """The global model Flower passes around (empty when the method has none)."""
        return EMPTY

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
        models, all the server learns (only strategies whose ``secure_aggregation_refusal`` is None)."""
        raise FedcondError(f"secure-aggregation=secaggplus cannot serve this method: {self.secure_aggregation_refusal}")

    def reply_extra_shapes(self) -> list[tuple[int, ...]]:
        """The shapes of the arrays a fit reply carries after its model (or each named part), in
        order: none here (``head-fit=ridge``: the Gram matrix, ``strategies/conditional.py``)."""
        return []

    def answer_floor(self) -> int:
        """The fewest clients that must answer a round, whatever ``min-answered-fraction`` says."""
        return 1

    def state(self) -> tuple[dict[str, Model], dict[str, Any]]:
        """What the next round needs beyond the global model: named models and plain values.

        Subclasses that hold more extend both (per-client entries keyed by partition id).
        """
        pending, participation = self.tracker.pending, self.tracker.pending_participation
        return {}, {
            "shared_config": dict(self.shared_config),
            "secure_sum_bytes": self.secure_sum_bytes,
            # evaluate-in-fit: the last round's record, whose evaluations the next round's fit brings.
            "pending_round": dataclasses.asdict(pending) if pending is not None else None,
            "pending_participation": participation.as_state() if participation is not None else None,
        }

    def checkpoint_saved(self) -> None:
        """Called once the checkpoint holding ``state`` is on disk: what an older one needed may go."""

    def load_state(self, models: dict[str, Model], values: dict[str, Any]) -> None:
        """Take back what ``state`` saved (a resumed run, in place of ``set_up``)."""
        self.shared_config = dict(values["shared_config"])
        self.secure_sum_bytes = int(values["secure_sum_bytes"])
        pending = values.get("pending_round")
        self.tracker.pending = RoundRecord(**pending) if pending else None
        participation = values.get("pending_participation")
        self.tracker.pending_participation = RoundParticipation.from_state(participation) if participation else None

    # -- Flower's Strategy API -------------------------------------------------------------------------
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        config = self.inputs.config
        self.membership.start(all_clients(client_manager, config))
        resume = self.inputs.resume
        if resume is None:
            self.set_up(client_manager)
            return self.initial_global()
        self.load_state(resume.models, resume.values)
        self.tracker.resume_after(resume.history)
        if GLOBAL_MODEL in resume.models:
            return ndarrays_to_parameters(resume.models[GLOBAL_MODEL])
        return EMPTY

    def secure_sum(
        self,
        instructions: list[tuple[PartitionProxy, FitIns]],
        server_round: int,
        client_manager: ClientManager,
        purpose: str,
        value_range: tuple[float, int],
        max_weight: float,
    ) -> SecureSum:
        """One sum through Flower's SecAgg+ (``fedcond.federation.secagg_workflow``) with this run's protocol
        values: every value clipped to +-``value_range[0]`` and quantised to ``value_range[1]`` levels,
        weights (training samples) up to ``max_weight``."""
        workflow = workflow_for(
            self.secure.num_shares, self.secure.reconstruction_threshold, *value_range, max_weight,
            message_timeout(self.inputs.config),
        )  # fmt: skip
        grid = self.inputs.grid_for(purpose)
        return run_secure_sum(grid, instructions, workflow, server_round, client_manager)  # type: ignore[arg-type]

    def check_secure_outcome(self, outcome: SecureSum, what: str, failures: list[Failure]) -> None:
        """Stop the run (one line) when SecAgg+ gave no sum, or one over fewer than ``secagg-min-clients``."""
        contributors, asked = len(outcome.contributors), len(outcome.contributors) + len(outcome.dropped)
        first = f"; first: {failures[0].line()}" if failures else ""
        if outcome.mean is None:
            raise FedcondError(
                f"{what}: SecAgg+ stopped with {contributors} of {asked} clients, too few for each to keep "
                f"secagg-reconstruction-threshold={self.secure.reconstruction_threshold:g} of its neighbours{first}; "
                "fix those clients or lower secagg-reconstruction-threshold"
            )
        if contributors < self.secure.min_clients:
            raise FedcondError(
                f"{what}: only {contributors} of {asked} clients are in the secure sum, fewer than "
                f"secagg-min-clients={self.secure.min_clients}{first}; fix those clients or lower secagg-min-clients"
            )

    def round_config(self, server_round: int) -> dict[str, Scalar]:
        return {SERVER_ROUND: server_round, **self.shared_config}

    def fit_round_config(self, server_round: int) -> dict[str, Scalar]:
        """A training round's settings: with a record pending (evaluate-in-fit), evaluate first."""
        config = self.round_config(server_round)
        return {**config, EVALUATE_FIRST: True} if self.tracker.pending is not None else config

    def instruct(
        self,
        stage: str,
        message: Callable[[Parameters, dict[str, Scalar]], Instruction],
        partitions: Iterable[int],
        server_round: int,
        current: Parameters,
        client_manager: ClientManager,
    ) -> list[tuple[ClientProxy, Instruction]]:
        """One instruction per connected client of ``partitions`` (``message``: Flower's ``FitIns`` or
        ``EvaluateIns``, of the method's ``instruction``; bytes counted); one asked but not connected
        fails ("node left"). Stops the run when too few are left to answer."""
        connected = self.membership.refresh(client_manager, server_round)
        config = self.fit_round_config(server_round) if stage == FIT else self.round_config(server_round)
        instructions: list[tuple[ClientProxy, Instruction]] = []
        for partition in partitions:
            if partition not in connected:
                self.participation.fail(stage, partition, NODE_LEFT)
                continue
            proxy = PartitionProxy(connected[partition], partition, self.participation, stage)
            instructions.append((proxy, message(*self.instruction(stage, partition, current, config))))
        self.enforce_policy(stage, asking=True)
        # Under SecAgg+ the fit step's bytes are counted from its messages (aggregate_secure_fit).
        if not self.peer_to_peer and not (stage == FIT and self.secure.model_updates):
            self.tracker.sent(sum(parameters_bytes(ins.parameters) for _, ins in instructions))
        return instructions

    def enforce_policy(self, stage: str, asking: bool = False) -> None:
        """Report the round's new failures (terminal, ``run.json``); stop the run when too few
        clients are left to answer it."""
        self.report_failures(self.participation.new_failures())
        self.participation.check(MIN_ANSWERED_FRACTION.of(self.inputs.config), self.answer_floor(), stage, asking)

    def report_failures(self, failures: list[Failure]) -> None:
        if failures and self.inputs.recorder is not None:
            self.inputs.recorder.add_events("failures", [failure.as_json() for failure in failures])
        if self.inputs.config.verbose:
            for failure in failures:
                print(f"fedcond: {failure.line()}", flush=True)

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        self.tracker.start_round()
        # The round's sample of training clients (every one without clients-per-round), whatever each
        # did before; held-out clients evaluate only, and every client when the round evaluates all.
        config = self.inputs.config
        self.sampled = sample_partitions(config.seed, server_round, self.training_partitions,
                                         clients_per_round(config))  # fmt: skip
        self.participation = RoundParticipation(server_round, self.asked_in(server_round))
        instructions = self.instruct(FIT, FitIns, self.sampled, server_round, parameters, client_manager)
        self.fit_stream = None
        if self.fold_fit_replies:
            expected: dict[int, float] = {}
            for proxy, _ in instructions:  # instruct made PartitionProxy objects only
                expected[proxy.partition_id] = float(self.inputs.training_samples(proxy.partition_id))  # type: ignore[attr-defined]
                proxy.on_fit_reply = self.fold_fit_reply  # type: ignore[attr-defined]
            self.fit_stream = StreamingAverage(expected)
        return instructions

    def fold_fit_reply(self, partition_id: int, res: FitRes | None) -> FitRes | None:
        """Called as each fit reply arrives (None: the instruction failed): its model goes into the
        round's running average and the reply is passed on without it (its bytes already counted)."""
        with self._stream_lock:
            stream = self.fit_stream
            if stream is None:
                return res
            if res is None or res.status.code != Code.OK or ERROR in res.metrics or not res.parameters.tensors:
                stream.withdraw(partition_id)
                return res
            self.tracker.bytes_up += parameters_bytes(res.parameters)
            stream.add(partition_id, parameters_to_ndarrays(res.parameters), res.num_examples)
            return FitRes(res.status, Parameters(tensors=[], tensor_type=FOLDED), res.num_examples, res.metrics)

    def aggregate_fit(
        self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures: Failures
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        stopping.check(f"round {server_round}'s fit replies")  # the stop's failures are no data
        answered = answered_replies(FIT, results, failures, self.participation)
        # The last round's row first: its evaluations came back even if the policy now stops the run;
        # a sampled client whose reply did not come did not evaluate it either.
        self.report_failures(self.tracker.complete_pending(evaluations_in(answered), self.sampled, self.participation))
        self.enforce_policy(FIT)
        self.tracker.received_fit(answered, count_bytes=not self.peer_to_peer)
        self.check_not_diverged(server_round)
        return self.combine(server_round, answered), {}

    def check_not_diverged(self, server_round: int) -> None:
        """Stop the run when the round's mean training loss exploded (``fedcond.model.training``)."""
        # Before round 1's row, and without a recorder, the round's own loss is the first.
        recorder = self.inputs.recorder
        first = recorder.first_train_loss if recorder is not None and recorder.records else self.tracker.train_loss
        check_not_diverged(server_round, self.tracker.train_loss, self.inputs.num_classes, first,
                           self.divergence_fix())  # fmt: skip

    def divergence_fix(self) -> str:
        """What to change when training diverges: the clients' learning rate, unless a method's own
        server step is the likelier cause (pFedHN's)."""
        return f"lower learning-rate (now {self.inputs.config.learning_rate:g})"

    def aggregate_secure_fit(self, server_round: int, outcome: SecureSum) -> Parameters | None:
        """The fit step's end under SecAgg+: the protocol's dropouts are the round's fit failures, the
        failure policy applies to the contributors, and the new global model comes from the mean
        alone (``combine_sum``); the mean's last array is the sample-weighted mean training loss."""
        stopping.check(f"round {server_round}'s secure sum")
        outcome.record_failures(self.participation, FIT)
        failures = self.participation.failures
        self.enforce_policy(FIT)
        self.check_secure_outcome(outcome, f"round {server_round}", list(failures))
        *model, loss = outcome.mean  # type: ignore[misc]
        # Under DP-SGD the clients withhold their loss (sent as 0): NaN, as without secure aggregation.
        train_loss = float("nan") if SampleLevelPrivacy.of(self.inputs.config).dp_sgd else float(loss[0])
        self.tracker.sent(outcome.bytes_down)
        self.tracker.received_secure_fit(outcome.bytes_up, train_loss, outcome.epsilon)
        self.check_not_diverged(server_round)
        return self.combine_sum(server_round, model)

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        # Also the clients whose fit failed: their evaluation still says how the model serves them.
        # With evaluate-in-fit the training clients evaluate this round's model in the next round's
        # fit: here only the held-out clients (who never train), and everyone after the last round.
        config = self.inputs.config
        asked = [*self.evaluated_in(server_round), *range(config.num_training_clients, config.num_clients)]
        return self.instruct(EVALUATE, EvaluateIns, asked, server_round, parameters, client_manager)

    def defers_evaluation(self, server_round: int) -> bool:
        """Whether the training clients evaluate round ``server_round``'s model in the next round's fit
        (those the next round samples), rather than by evaluate messages after this round."""
        return self.evaluates_in_fit and not scheduled_for_everyone(self.inputs.config, server_round)

    def evaluated_in(self, server_round: int) -> list[int]:
        """The training clients that evaluate round ``server_round``'s model by an evaluate message."""
        if self.defers_evaluation(server_round):
            return []
        if evaluates_everyone(self.inputs.config, server_round):
            return list(self.training_partitions)
        return self.sampled

    def asked_in(self, server_round: int) -> list[int]:
        """Every client a round asks anything: its sample, the evaluating clients, the held-out ones."""
        config = self.inputs.config
        held_out = range(config.num_training_clients, config.num_clients)
        return sorted({*self.sampled, *self.evaluated_in(server_round), *held_out})

    def aggregate_evaluate(
        self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]], failures: Failures
    ) -> tuple[float | None, dict[str, Scalar]]:
        stopping.check(f"round {server_round}'s evaluations")
        answered = answered_replies(EVALUATE, results, failures, self.participation)
        self.enforce_policy(EVALUATE)
        record = self.close_round(server_round, answered)
        return record.loss, {"accuracy": record.accuracy}

    def end_round(self, server_round: int) -> None:
        """Called by the round loop after the round's evaluation step: closes the round's record where
        that step asked no one (evaluate-in-fit without held-out clients), so Flower skipped it."""
        if self.closed_round != server_round:
            self.close_round(server_round, [])

    def close_round(self, server_round: int, answered: list[tuple[int, EvaluateRes]]) -> RoundRecord:
        """The round's record from the evaluations that came back (the training clients' may follow
        in the next round's fit replies: ``defers_evaluation``)."""
        training = self.inputs.config.num_training_clients
        held_out = [pair for pair in answered if pair[0] >= training]
        participating = [pair for pair in answered if pair[0] < training]
        self.closed_round = server_round
        self.record_class_accuracy(participating, held_out)
        return self.tracker.finish_round(
            server_round, participating, held_out, self.participation, self.defers_evaluation(server_round)
        )

    def record_class_accuracy(
        self, participating: list[tuple[int, EvaluateRes]], held_out: list[tuple[int, EvaluateRes]]
    ) -> None:
        """With ``per-class-accuracy``, the final round's accuracy per class over the participants' and
        over the newcomers' test sets, into ``run.json`` (``final_class_accuracy``)."""
        if self.inputs.recorder is None:
            return
        names = self.inputs.scenario.class_names if self.inputs.scenario is not None else ()
        record = {
            group: class_accuracy(
                ((array_from_bytes(res.metrics[CLASS_CORRECT], CLASS_CORRECT, INT64),
                  array_from_bytes(res.metrics[CLASS_COUNT], CLASS_COUNT, INT64))
                 for _, res in replies if CLASS_COUNT in res.metrics),
                names,
            )
            for group, replies in (("participants", participating), ("newcomers", held_out))
        }  # fmt: skip
        if any(record.values()):
            self.inputs.recorder.note("final_class_accuracy", record)

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        """No server-side evaluation: every client evaluates on its own test set."""
        return None
