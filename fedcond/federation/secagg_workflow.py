"""Secure aggregation on the server: one sum through Flower's ``SecAggPlusWorkflow``.

``run_secure_sum`` runs the workflow's four stages (set-up, key sharing, masked vectors, unmasking)
for a list of training instructions, as Flower's ``DefaultWorkflow`` would run its fit step: with a
``LegacyContext`` holding the round number and a strategy whose ``configure_fit`` hands the workflow
those instructions. The workflow then calls that strategy's ``aggregate_fit`` with the unmasked
*weighted mean* of the clients' vectors (every reply carries the same mean: Flower's legacy
compatibility); ``_Instructions`` keeps the mean and the survivors and nothing else reaches fedcond's
strategy. Which nodes dropped out, at which stage and why is read off the messages themselves
(``RecordingGrid``), as are the bytes every stage moved.

A client that drops out is a failure the sum survives while every client keeps at least the
reconstruction threshold of its neighbours (SecAgg+ then rebuilds the dropped client's masks from the
others' shares): before sending its masked vector, its input is left out; after, its input is in.
When too many drop out the workflow halts and there is no sum (``SecureSum.mean`` is None).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from flwr.common import (
    ArrayRecord,
    ConfigRecord,
    Context,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Message,
    Parameters,
    RecordDict,
    Scalar,
    parameters_to_ndarrays,
)
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
from flwr.server import ServerConfig
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState
from flwr.serverapp.grid import Grid
from flwr.supercore.run import Run

from fedcond import stopping
from fedcond.config import RunConfig
from fedcond.errors import FedcondError
from fedcond.federation.exchange import classify_failure, message_timeout
from fedcond.federation.membership import PartitionProxy
from fedcond.federation.messages import EPSILON
from fedcond.federation.participation import FAILED, TIMED_OUT, Failure, RoundParticipation
from fedcond.privacy.secure_aggregation import MODULUS, SecureAggregation


@dataclass
class SecureSum:
    """What one SecAgg+ aggregation gives the server: no client's own vector."""

    #: The weighted mean of the contributors' vectors (None: the protocol halted, no sum).
    mean: list[np.ndarray] | None
    #: Partition ids whose vectors are in the mean.
    contributors: list[int]
    #: Partition id -> (outcome, one-line reason) of every instructed client whose vector is not in it:
    #: first those that failed, then those left out because of them.
    dropped: dict[int, tuple[str, str]]
    #: Contributors that failed a later stage (unmasking): their vectors are in the mean all the same.
    late: dict[int, tuple[str, str]]
    bytes_down: int
    bytes_up: int
    #: The largest cumulative epsilon a contributor reported (sample-level DP; NaN without).
    epsilon: float = float("nan")

    def record_failures(self, participation: RoundParticipation, stage: str) -> None:
        """Every client the protocol left out, then every contributor that failed after its masked
        vector was collected (it is in the sum all the same), as failures of ``stage``; none once a stop
        is under way, or comes within a moment (``fedcond.stopping.settled``: a worker it killed)."""
        if self.dropped or self.late:
            stopping.settled(f"SecAgg+'s dropouts in {stage}")
        for partition, (how, reason) in self.dropped.items():
            participation.fail(stage, partition, reason, how)
        for partition, (how, reason) in self.late.items():
            participation.fail(
                stage, partition, f"{reason} (after its masked update was collected: it is in the sum)", how
            )


def run_secure_sum(
    grid: Grid,
    instructions: list[tuple[PartitionProxy, FitIns]],
    workflow: SecAggPlusWorkflow,
    server_round: int,
    client_manager: ClientManager,
) -> SecureSum:
    """The SecAgg+ mean of what ``instructions``' clients return (see the module docstring)."""
    recording = RecordingGrid(grid)
    strategy = _Instructions(instructions)
    context = LegacyContext(
        Context(run_id=grid.run.run_id, node_id=0, node_config={}, state=RecordDict(), run_config={}),
        config=ServerConfig(),  # the round loop is the caller's: the workflow runs one fit step
        strategy=strategy,
        client_manager=client_manager,
    )
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: server_round})
    context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()  # the instructions hold the parameters
    workflow(recording, context)
    mean = strategy.mean
    if mean is not None and instructions:
        # Flower dequantises to float64: the arrays that were sent go back to their own dtype (a
        # float32 model stays float32, and so does what the next round sends).
        sent = parameters_to_ndarrays(instructions[0][1].parameters)
        mean = [array.astype(like.dtype) for array, like in zip(mean, sent, strict=False)] + mean[len(sent) :]
    partition_of = {proxy.node_id: proxy.partition_id for proxy, _ in instructions}
    contributors = sorted(strategy.contributors)
    left_out = [node for node in partition_of if partition_of[node] not in strategy.contributors]
    # Those that failed first (by partition), then those the protocol left out because of them.
    left_out.sort(key=lambda node: (node not in recording.outcomes, partition_of[node]))
    dropped = {partition_of[node]: recording.outcome_of(node) for node in left_out}
    late = {
        partition_of[node]: recording.outcome_of(node)
        for node in partition_of
        if partition_of[node] in strategy.contributors and node in recording.outcomes
    }
    return SecureSum(mean, contributors, dropped, late, recording.bytes_down, recording.bytes_up, strategy.epsilon)


class SecAggPlus(SecAggPlusWorkflow):
    """Flower's ``SecAggPlusWorkflow`` with one fix to its books, so that an early dropout is one.

    Flower's workflow keeps every client it sampled in its books to the end: at the unmask stage it
    asks each client's neighbours for shares of the masking key of every client that is not active,
    including one that dropped out before sharing its keys. Nobody holds such shares (the clients
    then fail on a missing key) and nobody masked with that client, so the round could never finish.
    Right after key sharing this drops such clients from the books (sampled clients, neighbour
    sets): only clients that shared their keys remain, which is whom the others masked with.
    """

    def share_keys_stage(self, grid: Grid, context: LegacyContext, state: WorkflowState) -> bool:
        if not super().share_keys_stage(grid, context, state):
            return False
        shared = set(state.active_node_ids)
        state.sampled_node_ids = shared
        state.nid_to_neighbours = {
            node: neighbours & shared for node, neighbours in state.nid_to_neighbours.items() if node in shared
        }
        return self._check_threshold(state)


def workflow_for(
    num_shares: float, threshold: float, clipping_range: float, quantization_range: int, max_weight: float,
    timeout: float | None,
) -> SecAggPlusWorkflow:  # fmt: skip
    """Flower's workflow with fedcond's settings (fractions of the round's clients, Flower's float form)."""
    return SecAggPlus(
        num_shares=float(num_shares), reconstruction_threshold=float(threshold), max_weight=max_weight,
        clipping_range=clipping_range, quantization_range=quantization_range, modulus_range=MODULUS, timeout=timeout,
    )  # fmt: skip


class SecureRounds:
    """This run's secure sums through Flower's SecAgg+ (``run_secure_sum``) with its protocol values
    (``secagg-*`` settings), and the one-line stop when a sum came out too small."""

    def __init__(self, settings: SecureAggregation, config: RunConfig, grid: Grid | None) -> None:
        self.settings = settings
        self.config = config
        self.grid = grid

    def sum(
        self,
        instructions: list[tuple[PartitionProxy, FitIns]],
        server_round: int,
        client_manager: ClientManager,
        purpose: str,
        value_range: tuple[float, int],
        max_weight: float,
    ) -> SecureSum:
        """One sum: every value clipped to +-``value_range[0]`` and quantised to ``value_range[1]``
        levels, weights (training samples) up to ``max_weight``."""
        settings = self.settings
        workflow = workflow_for(
            settings.num_shares, settings.reconstruction_threshold, *value_range, max_weight,
            message_timeout(self.config),
        )  # fmt: skip
        if self.grid is None:
            raise FedcondError(f"{purpose} needs the run's grid; the ServerApp passes it")
        return run_secure_sum(self.grid, instructions, workflow, server_round, client_manager)  # type: ignore[arg-type]

    def check_outcome(self, outcome: SecureSum, what: str, failures: list[Failure]) -> None:
        """Stop the run (one line) when SecAgg+ gave no sum, or one over fewer than ``secagg-min-clients``."""
        contributors, asked = len(outcome.contributors), len(outcome.contributors) + len(outcome.dropped)
        first = f"; first: {failures[0].line()}" if failures else ""
        threshold = self.settings.reconstruction_threshold
        if outcome.mean is None:
            raise FedcondError(
                f"{what}: SecAgg+ stopped with {contributors} of {asked} clients, too few for each to keep "
                f"secagg-reconstruction-threshold={threshold:g} of its neighbours{first}; "
                "fix those clients or lower secagg-reconstruction-threshold"
            )
        if contributors < self.settings.min_clients:
            raise FedcondError(
                f"{what}: only {contributors} of {asked} clients are in the secure sum, fewer than "
                f"secagg-min-clients={self.settings.min_clients}{first}; fix those clients or lower secagg-min-clients"
            )


class _Instructions(Strategy):
    """The strategy the workflow talks to: gives it the round's instructions, keeps the mean it returns."""

    def __init__(self, instructions: list[tuple[PartitionProxy, FitIns]]) -> None:
        self.instructions = instructions
        self.mean: list[np.ndarray] | None = None
        self.contributors: set[int] = set()
        self.epsilon = float("nan")

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        return list(self.instructions)

    def aggregate_fit(
        self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures: list[object]
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        # Every reply carries the same unmasked mean; each proxy is one contributor.
        if results:
            self.mean = parameters_to_ndarrays(results[0][1].parameters)
        self.contributors = {proxy.partition_id for proxy, _ in results}  # type: ignore[attr-defined]
        # The only metric a masked reply keeps (fedcond/federation/secagg_mod.py): the DP accounting.
        spent = [float(res.metrics[EPSILON]) for _, res in results if EPSILON in res.metrics]  # type: ignore[arg-type]
        self.epsilon = max(spent, default=float("nan"))
        return None, {}  # fedcond's strategy combines the mean itself

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        raise NotImplementedError("a secure sum only runs the fit step")

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        raise NotImplementedError("a secure sum only runs the fit step")

    def aggregate_evaluate(
        self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]], failures: list[object]
    ) -> tuple[float | None, dict[str, Scalar]]:
        raise NotImplementedError("a secure sum only runs the fit step")

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        return None


@dataclass
class _NodeOutcome:
    outcome: str
    reason: str


class RecordingGrid(Grid):
    """The run's grid, passing every call on, that notes each node's first failed or missing reply
    and counts the bytes of every message's content both ways."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.bytes_down = 0
        self.bytes_up = 0
        self.outcomes: dict[int, _NodeOutcome] = {}

    def outcome_of(self, node: int) -> tuple[str, str]:
        noted = self.outcomes.get(node)
        if noted is None:  # sent nothing wrong, yet left out (the workflow halted before its stage)
            return FAILED, "left out: SecAgg+ stopped before its masked vector was collected"
        return noted.outcome, noted.reason

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        outgoing = list(messages)
        self.bytes_down += sum(content_bytes(message.content) for message in outgoing)
        started = time.monotonic()
        replies = list(self.grid.send_and_receive(outgoing, timeout=timeout))
        waited = time.monotonic() - started
        answered = set()
        stage = stage_of(outgoing[0]) if outgoing else ""
        for reply in replies:
            node = reply.metadata.src_node_id
            answered.add(node)
            if reply.has_error():
                # The client's own reason, or the SuperLink's word that its node left or it expired.
                outcome, reason = classify_failure(Exception(reply.error.reason), waited, timeout)
                self.outcomes.setdefault(node, _NodeOutcome(outcome, f"{reason} (SecAgg+ {stage} stage)"))
            else:
                self.bytes_up += content_bytes(reply.content)
        for message in outgoing:
            node = message.metadata.dst_node_id
            if node not in answered:
                timed_out = timeout is not None and waited >= timeout
                outcome = TIMED_OUT if timed_out else FAILED
                reason = f"no answer within round-timeout={timeout:g} s" if timed_out else "no answer (node left)"
                self.outcomes.setdefault(node, _NodeOutcome(outcome, f"{reason} (SecAgg+ {stage} stage)"))
        return replies

    # -- everything else goes to the run's grid unchanged ------------------------------------------
    def set_run(self, run: Run) -> None:  # pragma: no cover - the workflow never calls it
        self.grid.set_run(run)

    @property
    def run(self) -> Run:
        return self.grid.run

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None
    ) -> Message:
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)


def stage_of(message: Message) -> str:
    """The SecAgg+ stage a message of the workflow belongs to."""
    configs = message.content.config_records.get(RECORD_KEY_CONFIGS)
    return str(configs.get(Key.STAGE, "")) if configs is not None else ""


def content_bytes(content: RecordDict) -> int:
    """The payload of a message: its arrays' bytes and its config values' (8 per number)."""
    total = 0
    for record in content.array_records.values():
        total += sum(len(array.data) for array in record.values())
    for record in [*content.config_records.values(), *content.metric_records.values()]:
        for value in record.values():
            total += _value_bytes(value)
    return total


def _value_bytes(value: object) -> int:
    if isinstance(value, bytes | str):
        return len(value)
    if isinstance(value, list):
        return sum(_value_bytes(item) for item in value)
    return 8
