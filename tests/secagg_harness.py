"""SecAgg+ in one process, for the tests: Flower's workflow and fedcond's ClientApp, no Ray, no SuperLink.

``InProcessGrid`` hands every message the server sends to the real ClientApp of ``fedcond/federation/client_app.py``
(its mods included: SecAgg+'s, fedcond's checks, the clipping), one Flower ``Context`` per node that
persists across messages as a SuperNode's does, and keeps every reply: what the server sees.
``secure_round`` runs one aggregation through fedcond's ``fedcond.federation.secagg_workflow.run_secure_sum``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from uuid import uuid4

import numpy as np
from flwr.app import Error, Message, RecordDict
from flwr.common import Context, FitIns, ndarrays_to_parameters
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.server.client_manager import SimpleClientManager
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.serverapp.grid import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedcond.config import RunConfig
from fedcond.data.scenarios import scenario_for
from fedcond.federation.client_app import make_client_app
from fedcond.federation.membership import PartitionProxy
from fedcond.federation.participation import FIT, RoundParticipation
from fedcond.federation.secagg_workflow import SecureSum, run_secure_sum, workflow_for
from fedcond.federation.server_method import StrategyInputs
from fedcond.privacy.secure_aggregation import SecureAggregation

FIRST_NODE_ID = 1000


class InProcessGrid(Grid):
    """Nodes ``FIRST_NODE_ID + partition`` running fedcond's ClientApp in this process.

    ``fault(message, partition)`` may raise to make a node fail that message (a dropout).
    """

    def __init__(
        self, config: RunConfig, fault: Callable[[Message, int], None] | None = None, num_nodes: int | None = None
    ) -> None:
        # What start_grid sets for a ServerApp: whom the messages created here come from.
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID
        self.app = make_client_app(config)
        self.fault = fault
        count = num_nodes or config.num_clients
        self.contexts = {
            FIRST_NODE_ID + partition: Context(
                run_id=1,
                node_id=FIRST_NODE_ID + partition,
                state=RecordDict(),
                run_config={},
                node_config={"partition-id": partition, "num-partitions": config.num_clients},
            )
            for partition in range(count)
        }
        #: Every reply the server received, in order.
        self.replies: list[Message] = []
        self._run = Run.create_empty(1)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies = []
        for sent in messages:
            # A copy, as a SuperLink delivers one: the workflow sends one content object to many
            # nodes, and SecAgg+'s mod changes what it receives.
            message = copy.deepcopy(sent)
            message.metadata.__dict__["_message_id"] = str(uuid4())
            node = message.metadata.dst_node_id
            try:
                if self.fault is not None:
                    self.fault(message, node - FIRST_NODE_ID)
                reply = self.app(message, self.contexts[node])
            except Exception as error:  # what Flower's runtime turns a ClientApp's exception into
                reply = Message(Error(code=0, reason=f"<class '{type(error).__name__}'>:<'{error}'>"), reply_to=message)
            replies.append(reply)
        self.replies.extend(replies)
        return replies

    @property
    def run(self) -> Run:
        return self._run

    def set_run(self, run: Run) -> None:
        self._run = run

    def create_message(self, *args: object, **kwargs: object) -> Message:
        raise NotImplementedError

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError


def secure_round(
    grid: InProcessGrid,
    config: RunConfig,
    partitions: Iterable[int],
    parameters: list[np.ndarray],
    round_config: dict[str, object],
    server_round: int = 1,
) -> SecureSum:
    """One SecAgg+ aggregation of ``partitions``' fit replies to ``parameters``, as a round's fit step
    (SecAgg+'s largest weight: the largest training set, as the ServerApp sets it)."""
    settings = SecureAggregation.of(config)
    max_weight = float(StrategyInputs(config, 10, True, None, scenario=scenario_for(config)).largest_training_set)
    partitions = list(partitions)
    participation = RoundParticipation(server_round, partitions)
    instructions = [
        (
            PartitionProxy(GridClientProxy(FIRST_NODE_ID + partition, grid, 1), partition, participation, FIT),
            FitIns(ndarrays_to_parameters(parameters), dict(round_config)),  # type: ignore[arg-type]
        )
        for partition in partitions
    ]
    workflow = workflow_for(
        settings.num_shares, settings.reconstruction_threshold, settings.clipping_range, settings.quantization_range,
        max_weight, timeout=None,
    )  # fmt: skip
    return run_secure_sum(grid, instructions, workflow, server_round, SimpleClientManager())
