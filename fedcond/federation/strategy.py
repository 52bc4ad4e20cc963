"""The round protocol every method shares: ``FedcondStrategy``, the Flower strategy, composed with one
method's ``ServerMethod`` (``fedcond.federation.server_method``), whose hooks say what differs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, TypeVar

from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from fedcond import stopping
from fedcond.config import Option
from fedcond.data.scenarios import drift_partners_of
from fedcond.federation.exchange import NODE_TIMEOUT, ROUND_TIMEOUT, all_clients, message_timeout
from fedcond.federation.membership import Membership, PartitionProxy
from fedcond.federation.messages import (
    ACCURACY,
    EVALUATE_FIRST,
    EVALUATED_ACCURACY,
    EVALUATED_EXAMPLES,
    EVALUATED_LOSS,
    SERVER_ROUND,
    VALIDATION_KEYS,
)
from fedcond.federation.participation import EVALUATE, FIT, NODE_LEFT, RoundParticipation
from fedcond.federation.round_record import (
    MIN_ANSWERED_FRACTION,
    Failures,
    FoldedReplies,
    RoundTracker,
    answered_replies,
    parameters_bytes,
    record_class_accuracy,
)
from fedcond.federation.sampling import CLIENTS_PER_ROUND, EVALUATE_EVERY, RoundSchedule
from fedcond.federation.secagg_workflow import SecureRounds, SecureSum
from fedcond.federation.server_method import EMPTY, ServerMethod
from fedcond.model.aggregation import Model
from fedcond.privacy.dp import SampleLevelPrivacy
from fedcond.privacy.secure_aggregation import SecureAggregation
from fedcond.records.checkpoint import GLOBAL_MODEL
from fedcond.records.history import RoundRecord, dataset_metric

Instruction = TypeVar("Instruction", FitIns, EvaluateIns)

EVALUATE_IN_FIT = Option(
    "evaluate-in-fit",
    True,
    "one message per client per round: each training instruction also evaluates the model it brings (the last "
    "round's), the last round ends with one evaluate message; false: a fit and an evaluate message every round "
    "(the history is the same; under secure-aggregation the evaluate message stays, as the server sees no fit reply)",
)


def evaluations_in(fit_replies: list[tuple[int, FitRes]]) -> list[tuple[int, EvaluateRes]]:
    """The evaluations that fit replies carry (evaluate-in-fit), as the evaluate replies they replace."""
    return [
        (partition, EvaluateRes(res.status, float(res.metrics[EVALUATED_LOSS]), int(res.metrics[EVALUATED_EXAMPLES]),
                                {ACCURACY: res.metrics[EVALUATED_ACCURACY],
                                 **{key: res.metrics[key] for key in VALIDATION_KEYS if key in res.metrics}}))
        for partition, res in fit_replies
        if EVALUATED_LOSS in res.metrics
    ]  # fmt: skip


class FedcondStrategy(Strategy):
    """The round protocol, composed with one method (``self.method``, a ``ServerMethod``): each
    round's training clients (every one, or ``clients-per-round`` of them: ``RoundSchedule``) train
    and are evaluated; the history records each round. A client is its partition id throughout
    (``fedcond.federation.membership``), never Flower's node id. Before round 1 the protocol checks
    that one node per client is connected, asks each node which partition it holds and runs the
    method's own set-up exchange (``ServerMethod.set_up``; the conditional method's secure sum of
    fingerprint statistics, ``strategies/conditional.py``).

    With ``secure-aggregation = "secaggplus"`` the fit step of every round is SecAgg+'s
    (``fedcond.federation.round_loop``): the protocol gives the instructions as always, but never sees
    a reply; ``aggregate_secure_fit`` gets SecAgg+'s outcome (the sample-weighted mean of the
    contributors' models, who contributed, who dropped out and why) and the method's ``combine_sum``
    makes the new global model from the mean. A method that needs more than the sum says why in
    ``secure_aggregation_refusal``, and ``check_run`` refuses the combination.

    Failures (``fedcond.federation.participation``): each round asks every expected partition; a
    partition whose node is not connected fails ("node left"), as does a client that reports an
    error or raises; one that does not answer within ``round-timeout`` times out. ``combine`` sees
    only the clients that answered (weights renormalised over them), evaluation metrics are over the
    clients that answered evaluate, and when fewer clients can answer than ``min-answered-fraction``
    (and the method's ``answer_floor``) require, the run stops with one line. A client that failed is
    asked again the next round.

    After every round the ServerApp saves ``state()`` (the protocol's and the method's) into the
    run's checkpoint; a resumed run calls ``load_state`` before its first round instead of setting
    up afresh (no secure sum: the published statistics are part of the state). Per-client state is
    saved by partition id, the one name a client keeps across runs (Flower's node ids are new in
    every run).

    Held-out clients (``held-out-clients`` per cluster, partition ids after the training clients)
    are never asked to train: they only evaluate, each round, the model a method would give them,
    and their accuracy is recorded apart (``heldout_accuracy``). They do not take part in the secure
    sum: they stand for clients that join after the federation was set up, so nothing the training
    clients see may depend on their data; they receive the published mean and standard deviation.
    """

    #: Settings of the round protocol every method shares (failure policy, time limits).
    protocol_options: ClassVar[tuple[Option, ...]] = (
        NODE_TIMEOUT, MIN_ANSWERED_FRACTION, ROUND_TIMEOUT, EVALUATE_IN_FIT, CLIENTS_PER_ROUND, EVALUATE_EVERY,
    )  # fmt: skip

    def __init__(self, method: ServerMethod) -> None:
        self.method = method
        method.protocol = self
        self.inputs = inputs = method.inputs
        config = inputs.config
        drifting = frozenset(drift_partners_of(config)) if config.drift_round else frozenset()
        self.tracker = RoundTracker(
            inputs.recorder, config.num_server_rounds, inputs.true_clusters, config.verbose, drifting,
            dataset_metric(config.dataset),
        )  # fmt: skip
        #: Settings every instruction carries beyond the round number (the published fingerprint statistics).
        self.shared_config: dict[str, Scalar] = {}
        self.secure_sum_bytes = 0
        self.secure = SecureAggregation.of(config)
        self.secure_rounds = SecureRounds(self.secure, config, inputs.grid)
        self.membership = Membership(config.num_clients, message_timeout(config), inputs.recorder, config.verbose)
        self.participation = RoundParticipation(0, ())
        #: Set by the round loop (fedcond/federation/round_loop.py) where nothing needs each reply's own
        #: model: each fit reply is then folded into ``folded`` as it arrives.
        self.fold_fit_replies = False
        self.folded = FoldedReplies(self.tracker)
        #: The round loop's thread limit (Flower's ``max_workers``), for messages a method sends itself.
        self.max_workers: int | None = None
        # SecAgg+ hands the server no fit reply, only the sum: an evaluation cannot ride in one.
        # A drift run scores each round's model on the data the clients hold in that round (fedcond.data.drift).
        evaluates_in_fit = EVALUATE_IN_FIT.of(config) and not self.secure.model_updates and not config.drift_round
        self.schedule = RoundSchedule(config, evaluates_in_fit)
        #: The last round whose record was closed (``end_round``).
        self.closed_round = 0

    def __repr__(self) -> str:
        return f"FedcondStrategy({self.method!r})"

    # -- Flower's Strategy API -------------------------------------------------------------------------
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        config = self.inputs.config
        self.membership.start(all_clients(client_manager, config))
        resume = self.inputs.resume
        if resume is None:
            self.method.set_up(client_manager)
            return self.method.initial_global()
        self.load_state(resume.models, resume.values)
        self.tracker.resume_after(resume.history)
        if GLOBAL_MODEL in resume.models:
            return ndarrays_to_parameters(resume.models[GLOBAL_MODEL])
        return EMPTY

    def round_config(self, server_round: int, stage: str = EVALUATE) -> dict[str, Scalar]:
        """The settings every instruction of the round carries; a training round's, with a record
        pending (evaluate-in-fit), also says to evaluate first."""
        config: dict[str, Scalar] = {SERVER_ROUND: server_round, **self.shared_config}
        return {**config, EVALUATE_FIRST: True} if stage == FIT and self.tracker.pending is not None else config

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
        config = self.round_config(server_round, stage)
        instructions: list[tuple[ClientProxy, Instruction]] = []
        for partition in partitions:
            if partition not in connected:
                self.participation.fail(stage, partition, NODE_LEFT)
                continue
            proxy = PartitionProxy(connected[partition], partition, self.participation, stage)
            instructions.append((proxy, message(*self.method.instruction(stage, partition, current, config))))
        self.enforce_policy(stage, asking=True)
        # Under SecAgg+ the fit step's bytes are counted from its messages (aggregate_secure_fit).
        if not self.method.peer_to_peer and not (stage == FIT and self.secure.model_updates):
            self.tracker.sent(sum(parameters_bytes(ins.parameters) for _, ins in instructions))
        return instructions

    def enforce_policy(self, stage: str, asking: bool = False) -> None:
        """Report the round's new failures (terminal, ``run.json``); stop the run when too few
        clients are left to answer it."""
        self.tracker.report_failures(self.participation.new_failures())
        self.participation.check(MIN_ANSWERED_FRACTION.of(self.inputs.config), self.method.answer_floor(), stage,
                                 asking)  # fmt: skip

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        self.method.start_round(server_round)
        self.tracker.start_round()
        # The round's sample of training clients; held-out clients evaluate only, and every client
        # when the round evaluates all.
        sampled = self.schedule.sample(server_round)
        self.participation = RoundParticipation(server_round, self.schedule.asked_in(server_round))
        instructions = self.instruct(FIT, FitIns, sampled, server_round, parameters, client_manager)
        expected: dict[int, float] | None = None
        if self.fold_fit_replies:
            expected = {}
            for proxy, _ in instructions:  # instruct made PartitionProxy objects only
                expected[proxy.partition_id] = float(self.inputs.training_samples(proxy.partition_id))  # type: ignore[attr-defined]
                proxy.on_fit_reply = self.folded.fold  # type: ignore[attr-defined]
        self.folded.start(expected)
        return instructions

    def aggregate_fit(
        self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures: Failures
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        stopping.check(f"round {server_round}'s fit replies")  # the stop's failures are no data
        answered = answered_replies(FIT, results, failures, self.participation)
        # The last round's row first: its evaluations came back even if the policy now stops the run;
        # a sampled client whose reply did not come did not evaluate it either.
        self.tracker.report_failures(
            self.tracker.complete_pending(evaluations_in(answered), self.schedule.sampled, self.participation)
        )
        self.enforce_policy(FIT)
        self.tracker.received_fit(answered, count_bytes=not self.method.peer_to_peer)
        self.tracker.check_not_diverged(server_round, self.inputs.num_classes, self.method.divergence_fix())
        return self.method.combine(server_round, answered), {}

    def aggregate_secure_fit(self, server_round: int, outcome: SecureSum) -> Parameters | None:
        """The fit step's end under SecAgg+: the protocol's dropouts are the round's fit failures, the
        failure policy applies to the contributors, and the new global model comes from the mean
        alone (the method's ``combine_sum``); the mean's last array is the sample-weighted mean
        training loss."""
        stopping.check(f"round {server_round}'s secure sum")
        outcome.record_failures(self.participation, FIT)
        failures = self.participation.failures
        self.enforce_policy(FIT)
        self.secure_rounds.check_outcome(outcome, f"round {server_round}", list(failures))
        *model, loss = outcome.mean  # type: ignore[misc]
        # Under DP-SGD the clients withhold their loss (sent as 0): NaN, as without secure aggregation.
        train_loss = float("nan") if SampleLevelPrivacy.of(self.inputs.config).dp_sgd else float(loss[0])
        self.tracker.sent(outcome.bytes_down)
        self.tracker.received_secure_fit(outcome.bytes_up, train_loss, outcome.epsilon)
        self.tracker.check_not_diverged(server_round, self.inputs.num_classes, self.method.divergence_fix())
        return self.method.combine_sum(server_round, model)

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        self.method.before_evaluation(server_round, client_manager)
        # Also the clients whose fit failed: their evaluation still says how the model serves them.
        # With evaluate-in-fit the training clients evaluate this round's model in the next round's
        # fit: here only the held-out clients (who never train), and everyone after the last round.
        asked = [*self.schedule.evaluated_in(server_round), *self.schedule.held_out]
        return self.instruct(EVALUATE, EvaluateIns, asked, server_round, parameters, client_manager)

    def aggregate_evaluate(
        self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]], failures: Failures
    ) -> tuple[float | None, dict[str, Scalar]]:
        stopping.check(f"round {server_round}'s evaluations")
        answered = answered_replies(EVALUATE, results, failures, self.participation)
        self.enforce_policy(EVALUATE)
        record = self.end_round(server_round, answered)
        return (record.loss, {"accuracy": record.accuracy}) if record is not None else (None, {})

    def end_round(self, server_round: int, answered: list[tuple[int, EvaluateRes]] | None = None) -> RoundRecord | None:
        """Close the round's record, once, from the evaluations that came back (the training clients'
        may follow in the next round's fit replies: ``RoundSchedule.defers_evaluation``). The round
        loop calls it after the round's evaluation step, which closed it unless the step asked no one
        (evaluate-in-fit without held-out clients), so Flower skipped it: None then."""
        if self.closed_round == server_round:
            return None
        training = self.inputs.config.num_training_clients
        held_out = [pair for pair in answered or [] if pair[0] >= training]
        participating = [pair for pair in answered or [] if pair[0] < training]
        self.closed_round = server_round
        names = self.inputs.scenario.class_names if self.inputs.scenario is not None else ()
        record_class_accuracy(self.inputs.recorder, names, participating, held_out)
        return self.tracker.finish_round(
            server_round, participating, held_out, self.participation, self.schedule.defers_evaluation(server_round)
        )

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        """No server-side evaluation: every client evaluates on its own test set."""
        return None

    # -- the checkpoint: the protocol's state and the method's ------------------------------------------
    def state(self) -> tuple[dict[str, Model], dict[str, Any]]:
        """What the next round needs beyond the global model: the method's named models and values,
        and the protocol's own (the published settings, the record evaluate-in-fit still waits on)."""
        models, values = self.method.state()
        pending, participation = self.tracker.pending, self.tracker.pending_participation
        return models, {
            "shared_config": dict(self.shared_config),
            "secure_sum_bytes": self.secure_sum_bytes,
            # evaluate-in-fit: the last round's record, whose evaluations the next round's fit brings.
            "pending_round": dataclasses.asdict(pending) if pending is not None else None,
            "pending_participation": participation.as_state() if participation is not None else None,
            **values,
        }

    def load_state(self, models: dict[str, Model], values: dict[str, Any]) -> None:
        """Take back what ``state`` saved (a resumed run, in place of the method's ``set_up``)."""
        self.shared_config = dict(values["shared_config"])
        self.secure_sum_bytes = int(values["secure_sum_bytes"])
        pending = values.get("pending_round")
        self.tracker.pending = RoundRecord(**pending) if pending else None
        participation = values.get("pending_participation")
        self.tracker.pending_participation = RoundParticipation.from_state(participation) if participation else None
        self.method.load_state(models, values)

    def checkpoint_saved(self) -> None:
        """Called once the checkpoint holding ``state`` is on disk: what an older one needed may go."""
        self.method.checkpoint_saved()
