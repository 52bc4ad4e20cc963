"""Strategies that hold one model per cluster: Oracle (true clusters) and IFCA (chosen clusters)."""

from __future__ import annotations

from typing import Any

from flwr.common import FitRes, Parameters, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_proxy import ClientProxy
from sklearn.metrics import adjusted_rand_score

from fedcond.aggregation import Model, average_per_group
from fedcond.errors import FedcondError
from fedcond.messages import CHOICE, CLUSTER
from strategies.base import FedcondStrategy, StrategyInputs, initial_weights


class ClusterModels(FedcondStrategy):
    """K models on the server; each client is assigned one, and each model averages its clients."""

    def __init__(self, inputs: StrategyInputs, models: list[Model]) -> None:
        super().__init__(inputs)
        self.models = models
        self.assignment: dict[str, int] = {}

    def model_of(self, proxy: ClientProxy) -> Parameters:
        return ndarrays_to_parameters(self.models[self.assignment[proxy.cid]])

    def evaluate_parameters(self, proxy: ClientProxy, current: Parameters) -> Parameters:
        return self.model_of(proxy)

    def groups(self, results: list[tuple[ClientProxy, FitRes]]) -> list[int]:
        raise NotImplementedError

    def combine(self, server_round: int, results: list[tuple[ClientProxy, FitRes]]) -> Parameters | None:
        groups = self.groups(results)
        updates = [parameters_to_ndarrays(res.parameters) for _, res in results]
        self.models = average_per_group(self.models, updates, groups, [res.num_examples for _, res in results])
        return None

    def state(self) -> tuple[dict[str, Model], dict[str, Any]]:
        models, values = super().state()
        models.update({f"cluster-{index}": model for index, model in enumerate(self.models)})
        # JSON-like keys: the partition id, as text.
        values["assignment"] = {str(pid): cluster for pid, cluster in self.keyed_by_partition(self.assignment).items()}
        return models, values

    def load_state(self, models: dict[str, Model], values: dict[str, Any]) -> None:
        super().load_state(models, values)
        self.models = [models[f"cluster-{index}"] for index in range(len(self.models))]
        self.assignment = self.keyed_by_node({int(pid): int(cluster) for pid, cluster in values["assignment"].items()})


class OracleStrategy(ClusterModels):
    """Oracle: FedAvg within each true cluster, one model per cluster.

    The server asks every client its true cluster before round 1, which no real method could do:
    Oracle is the reference that shows what perfect clustering achieves, not a competitor. A held-out
    client evaluates its true cluster's model.
    """

    serves_held_out_clients = True

    def __init__(self, inputs: StrategyInputs) -> None:
        super().__init__(inputs, [initial_weights(inputs) for _ in range(inputs.config.num_clusters)])

    def on_start(self, proxies: list[ClientProxy]) -> None:
        self.assignment = {proxy.cid: int(self.identities[proxy.cid][CLUSTER]) for proxy in proxies}

    def fit_parameters(self, proxy: ClientProxy, current: Parameters) -> Parameters:
        return self.model_of(proxy)

    def groups(self, results: list[tuple[ClientProxy, FitRes]]) -> list[int]:
        return [self.assignment[proxy.cid] for proxy, _ in results]


class IfcaStrategy(ClusterModels):
    """IFCA (Ghosh et al. 2020): K models, each client trains the one with its lowest training loss.

    Every round all K models go to every client (K times FedAvg's download); each client returns
    its trained choice, and each model becomes the sample-weighted average of the clients that chose
    it (a model nobody chose is kept). K = ``num-clusters``, models randomly initialised with
    distinct seeds, no restarts. Clients evaluate the model they chose last. The Adjusted Rand Index
    between choices and true clusters is recorded every round.
    """

    def __init__(self, inputs: StrategyInputs) -> None:
        seeds = [inputs.config.seed * 1000 + k for k in range(inputs.config.num_clusters)]
        super().__init__(inputs, [initial_weights(inputs, seed) for seed in seeds])

    def fit_parameters(self, proxy: ClientProxy, current: Parameters) -> Parameters:
        return ndarrays_to_parameters([array for model in self.models for array in model])

    def groups(self, results: list[tuple[ClientProxy, FitRes]]) -> list[int]:
        choices = [int(res.metrics[CHOICE]) for _, res in results]
        if any(not 0 <= choice < len(self.models) for choice in choices):
            raise FedcondError("an IFCA client chose a model that does not exist; server and client disagree on K")
        self.assignment.update({proxy.cid: choice for (proxy, _), choice in zip(results, choices, strict=True)})
        truth = [int(res.metrics[CLUSTER]) for _, res in results]
        self.tracker.set_ari(float(adjusted_rand_score(truth, choices)))
        return choices
