"""A whole federated run in this process, without Ray or a SuperLink: the ServerApp's round loop
(``CheckpointingServer`` with the method's strategy) and each partition's real ClientApp client,
reached through in-process proxies that count the messages they carry.

A second or so per small run: for tests that compare protocols method by method, and the runner of
``fedcond sweep --runner in-process`` (a GPU machine without Ray). It has no grid, so no SecAgg+: the
conditioned methods' fingerprint statistics (``normalisation=federated``) are summed in the clear here
(``plain_sum``: the same statistics, the same mean and standard deviation every client receives), and
secure aggregation of model updates is refused. Of the client mods, client-level DP's clipping
(``client-dp = "client-side"``) applies as the ClientApp's mod applies it (``clipped_without_messages``).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from flwr.common import (
    Context,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetPropertiesIns,
    GetPropertiesRes,
    RecordDict,
    parameters_to_ndarrays,
)
from flwr.server.client_proxy import ClientProxy

from fedcond.config import RunConfig
from fedcond.errors import FedcondError
from fedcond.federation.client_app import build_client
from fedcond.federation.clipping_mod import clipped_without_messages
from fedcond.federation.membership import PartitionProxy
from fedcond.federation.secagg_workflow import SecureSum
from fedcond.federation.server_app import served_run
from fedcond.privacy.secure_aggregation import SecureAggregation
from fedcond.records.history import RunRecorder


class InProcessNode(ClientProxy):
    """One node holding ``partition_id``: each message builds the ClientApp's client afresh on the
    node's persistent ``Context``, as Flower does, and answers it here; ``messages`` counts them."""

    def __init__(self, config: RunConfig, partition_id: int, messages: Counter[str]) -> None:
        super().__init__(f"node-{partition_id}")
        self.config = config
        node_config = {"partition-id": partition_id, "num-partitions": config.num_clients}
        self.context = Context(0, partition_id + 1, node_config, RecordDict(), {})  # type: ignore[arg-type]
        self.messages = messages

    def get_properties(self, ins: GetPropertiesIns, timeout: float | None, group_id: int | None) -> GetPropertiesRes:
        return build_client(self.context, self.config).get_properties(ins)

    def fit(self, ins: FitIns, timeout: float | None, group_id: int | None) -> FitRes:
        self.messages["fit"] += 1
        return clipped_without_messages(ins, build_client(self.context, self.config).fit(ins))

    def evaluate(self, ins: EvaluateIns, timeout: float | None, group_id: int | None) -> EvaluateRes:
        self.messages["evaluate"] += 1
        return build_client(self.context, self.config).evaluate(ins)

    def get_parameters(self, *args: object) -> None:
        raise NotImplementedError

    def reconnect(self, *args: object) -> None:
        raise NotImplementedError


def plain_sum(instructions: list[tuple[PartitionProxy, FitIns]], *_: object, **__: object) -> SecureSum:
    """What SecAgg+'s sum gives the strategy (``SecureRounds.sum``), computed in the clear: the
    weighted mean of every instructed client's reply. The fingerprint statistics are exact digits
    (``fedcond.fingerprint.statistics_encoding``), so their mean is SecAgg+'s."""
    replies = [(proxy.partition_id, proxy.fit(ins, None, None)) for proxy, ins in instructions]
    weights = np.array([reply.num_examples for _, reply in replies], dtype=np.float64)
    arrays = [parameters_to_ndarrays(reply.parameters) for _, reply in replies]
    mean = [sum(w * a[i].astype(np.float64) for w, a in zip(weights, arrays, strict=True)) / weights.sum()
            for i in range(len(arrays[0]))]  # fmt: skip
    return SecureSum(mean, sorted(partition for partition, _ in replies), {}, {}, 0, 0)


def run_in_process(config: RunConfig) -> tuple[RunRecorder, Counter[str]]:
    """Run ``config`` to the end with one client at a time (they share this process's model), as the
    ServerApp runs it (``fedcond.federation.server_app.served_run``: its checks, results folder, resume and
    failure record); the run's recorder (its folder under ``results-dir``) and the fit and evaluate
    messages sent."""
    if SecureAggregation.of(config).model_updates:
        raise FedcondError(
            "secure-aggregation of model updates needs Flower's SecAgg+ grid, which the in-process runner has not; "
            "run it through flwr run (fedcond run, or sweep without --runner in-process)"
        )
    messages: Counter[str] = Counter()
    resolved = config.resolved()
    with served_run(config, None) as (server, strategy, rounds_left):
        strategy.secure_rounds.sum = plain_sum  # type: ignore[method-assign]
        server.set_max_workers(1)
        for partition in range(resolved.num_clients):
            server.client_manager().register(InProcessNode(resolved, partition, messages))
        server.fit(rounds_left, timeout=None)
    return server.recorder, messages
