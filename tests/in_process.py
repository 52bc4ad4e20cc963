"""A whole federated run in this process, without Ray or a SuperLink: the ServerApp's round loop
(``CheckpointingServer`` with the method's strategy) and each partition's real ClientApp client,
reached through in-process proxies that count the messages they carry.

A second or so per small run: for tests that compare protocols method by method. It has no grid,
so no SecAgg+ (a conditioned method here normalises without the federated statistics), and no
client mods (client-level DP only with server-side clipping).
"""

from __future__ import annotations

from collections import Counter

from flwr.common import (
    Context,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetPropertiesIns,
    GetPropertiesRes,
    RecordDict,
)
from flwr.server.client_proxy import ClientProxy

from clients.app import build_client
from fedcond.config import RunConfig
from fedcond.history import RunRecorder, open_run
from fedcond.scenarios import scenario_for
from strategies import client_dp
from strategies.base import StrategyInputs
from strategies.registry import federated, get_method
from strategies.round_loop import CheckpointingServer


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
        return build_client(self.context, self.config).fit(ins)

    def evaluate(self, ins: EvaluateIns, timeout: float | None, group_id: int | None) -> EvaluateRes:
        self.messages["evaluate"] += 1
        return build_client(self.context, self.config).evaluate(ins)

    def get_parameters(self, *args: object) -> None:
        raise NotImplementedError

    def reconnect(self, *args: object) -> None:
        raise NotImplementedError


def run_in_process(config: RunConfig) -> tuple[RunRecorder, Counter[str]]:
    """Run ``config`` to the end with one client at a time (they share this process's model); the
    run's recorder (its folder under ``results-dir``) and the fit and evaluate messages sent."""
    method = get_method(config.method)
    _, strategy_class = federated(method)
    config = config.resolved()
    scenario = scenario_for(config)
    recorder = open_run(config, scenario, method.name, method.summary, method.conditioned)
    strategy = strategy_class(
        StrategyInputs(config, scenario.num_classes, method.conditioned, recorder, None, scenario)
    )
    messages: Counter[str] = Counter()
    server = CheckpointingServer(strategy, recorder, 0, client_dp.with_client_dp(strategy, config))
    server.set_max_workers(1)
    for partition in range(config.num_clients):
        server.client_manager().register(InProcessNode(config, partition, messages))
    server.fit(config.num_server_rounds, timeout=None)
    recorder.finish()
    return recorder, messages
