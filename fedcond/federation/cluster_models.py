"""The family base of the methods that hold one model per cluster (Oracle, IFCA, CFL, descriptor
clustering): the K models, their assignment, averaging within each, ARI against the true clusters."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from flwr.common import FitRes, Parameters, Scalar, ndarrays_to_parameters, parameters_to_ndarrays
from sklearn.metrics import adjusted_rand_score

from fedcond.data.drift import cluster_at
from fedcond.data.scenarios import drift_partners_of
from fedcond.federation.participation import EVALUATE
from fedcond.federation.server_method import ServerMethod, StrategyInputs
from fedcond.model.aggregation import Model, average_per_group
from fedcond.model.networks import build_run_model, trained_arrays
from fedcond.model.server_optimiser import PerModelMomentum


class ClusterModels(ServerMethod):
    """K models on the server; each client is assigned one, and each model averages its clients.

    A round needs at least one answering client per model (K), whatever ``min-answered-fraction``
    allows; a model none of whose clients answered keeps its parameters for that round.

    With ``server-momentum`` (FedAvgM, ``fedcond.model.server_optimiser``) each model is its own FedAvgM
    stream: its new parameters are the server's step from the model its clients received along its
    round's average, and a model that got no reply keeps its parameters and its velocity. The
    velocities are part of the checkpoint.
    """

    #: Each model's server averages its clients' models: FedAvgM steps each (None: no refusal).
    server_step_refusal = None

    def __init__(self, inputs: StrategyInputs, models: list[Model]) -> None:
        super().__init__(inputs)
        self.models = models
        #: Partition id -> the model it is assigned (Oracle: its true cluster; IFCA: its last choice).
        self.assignment: dict[int, int] = {}
        #: FedAvgM's state, one stream per model (None: plain FedAvg within each, no optimiser at all).
        self.server_momentum = PerModelMomentum.of(inputs.config, self.trained_mask, len(models))
        #: Client-level DP's noise on a model's mean of its clients' clipped updates, given the mean and
        #: how many clients it averages (set by ``client_dp.with_client_dp`` for a method that declares
        #: ``client_dp_per_model``; None: no client-level DP).
        self.noised_mean: Callable[[Model, int], Model] | None = None

    def trained_mask(self) -> list[bool]:
        """Per array of a model: a trained weight (stepped by FedAvgM) or a buffer (averaged as it is)."""
        inputs = self.inputs
        return trained_arrays(build_run_model(inputs.config, inputs.num_classes, inputs.conditioned))

    def array_names(self) -> list[str]:
        """A model's arrays by name, in ``state_dict`` order (what travels)."""
        inputs = self.inputs
        return list(build_run_model(inputs.config, inputs.num_classes, inputs.conditioned).state_dict())

    def record_ari(self, truth: list[int], labels: list[int]) -> float:
        """The Adjusted Rand Index of ``labels`` (the clusters found or chosen) against ``truth`` (the
        server's scenario, never sent by a client), into this round's record. NaN where the scenario
        has no clusters (a Dirichlet or pathological partition): there is nothing to recover."""
        from fedcond.data.scenarios import scenario_kind

        if not scenario_kind(self.inputs.config.scenario).clustered:
            return math.nan
        ari = float(adjusted_rand_score(truth, labels))
        self.protocol.tracker.set_ari(ari)
        return ari

    def model_of(self, partition_id: int) -> Parameters:
        return ndarrays_to_parameters(self.models[self.assignment[partition_id]])

    def all_models(self) -> Parameters:
        return ndarrays_to_parameters([array for model in self.models for array in model])

    def instruction(
        self, stage: str, partition_id: int, current: Parameters, config: dict[str, Scalar]
    ) -> tuple[Parameters, dict[str, Scalar]]:
        # A client the server has not placed (IFCA's before its first choice, a CFL newcomer) gets
        # every model and evaluates the one with the lowest loss on its training data.
        if stage == EVALUATE and partition_id not in self.assignment:
            return self.all_models(), config
        return self.model_of(partition_id), config

    def answer_floor(self) -> int:
        return len(self.models)

    def groups(self, server_round: int, results: list[tuple[int, FitRes]]) -> list[int]:
        """Each reply's model: its client's assignment (IFCA: the client's own choice)."""
        return [self.assignment[partition] for partition, _ in results]

    def true_clusters_at(self, server_round: int) -> dict[int, int]:
        """Each client's true cluster in ``server_round`` (the simulation's scenario, which no client
        sends): its own, or its drift partner's from drift-round on (fedcond.data.drift)."""
        config, clusters = self.inputs.config, self.inputs.true_clusters
        partners = drift_partners_of(config)
        return {
            pid: cluster_at(pid, server_round, config.drift_round, partners, clusters) for pid in range(len(clusters))
        }

    def combine(self, server_round: int, results: list[tuple[int, FitRes]]) -> Parameters | None:
        groups = self.groups(server_round, results)
        updates = [parameters_to_ndarrays(res.parameters) for _, res in results]
        averages = average_per_group(self.models, updates, groups, [res.num_examples for _, res in results])
        if self.noised_mean is not None:  # before any server step: FedAvgM post-processes what DP released
            for group in sorted(set(groups)):  # in model order: the noise is drawn alike each time
                averages[group] = self.noised_mean(averages[group], groups.count(group))
        if self.server_momentum is not None:  # each model that got a reply steps along its own average
            averages = self.server_momentum.step(self.models, averages, set(groups))
        self.models = averages
        return None

    def state(self) -> tuple[dict[str, Model], dict[str, Any]]:
        models, values = super().state()
        models.update({f"cluster-{index}": model for index, model in enumerate(self.models)})
        if self.server_momentum is not None:
            models.update(self.server_momentum.state())
        # JSON-like keys: the partition id, as text.
        values["assignment"] = {str(pid): cluster for pid, cluster in self.assignment.items()}
        return models, values

    def load_state(self, models: dict[str, Model], values: dict[str, Any]) -> None:
        super().load_state(models, values)
        self.models = [models[f"cluster-{index}"] for index in range(len(self.models))]
        self.assignment = {int(pid): int(cluster) for pid, cluster in values["assignment"].items()}
        if self.server_momentum is not None:
            self.server_momentum.load_state(models, len(self.models))
