"""Strategies that hold one model per cluster: Oracle (true clusters) and IFCA (chosen clusters)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from flwr.common import FitRes, Parameters, Scalar, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import ClientManager
from sklearn.metrics import adjusted_rand_score

from fedcond.config import Option, RunConfig
from fedcond.data.drift import cluster_at
from fedcond.data.scenarios import drift_partners_of
from fedcond.errors import FedcondError
from fedcond.fingerprint.descriptor_clustering import DescriptorClusters, cluster_descriptors
from fedcond.messages import (
    CHOICE,
    DESCRIPTOR,
    EVALUATE_CHOICE,
    EVALUATE_FIRST,
    STEP,
    STEP_DESCRIPTOR,
    array_from_bytes,
)
from fedcond.model.aggregation import Model, average_per_group
from fedcond.model.networks import build_run_model, trained_arrays
from fedcond.model.server_optimiser import PerModelMomentum
from fedcond.participation import EVALUATE, FIT
from strategies.base import FedcondStrategy, StrategyInputs, initial_weights
from strategies.federation import ask_all, message_timeout


class ClusterModels(FedcondStrategy):
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

    def trained_mask(self) -> list[bool]:
        """Per array of a model: a trained weight (stepped by FedAvgM) or a buffer (averaged as it is)."""
        inputs = self.inputs
        return trained_arrays(build_run_model(inputs.config, inputs.num_classes, inputs.conditioned))

    def record_ari(self, truth: list[int], labels: list[int]) -> float:
        """The Adjusted Rand Index of ``labels`` (the clusters found or chosen) against ``truth`` (the
        server's scenario, never sent by a client), into this round's record. NaN where the scenario
        has no clusters (a Dirichlet or pathological partition): there is nothing to recover."""
        from fedcond.data.scenarios import scenario_kind

        if not scenario_kind(self.inputs.config.scenario).clustered:
            return math.nan
        ari = float(adjusted_rand_score(truth, labels))
        self.tracker.set_ari(ari)
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


class OracleStrategy(ClusterModels):
    """Oracle: FedAvg within each true cluster, one model per cluster.

    Oracle is the reference that is told the true clusters: its server reads each partition's cluster
    from the simulation's scenario (ground truth no client sends, and no real method could know). It
    shows what perfect clustering achieves; it is not a competitor. A held-out client evaluates its
    true cluster's model.
    """

    serves_held_out_clients = True
    uses_true_clusters = True
    secure_aggregation_refusal = (
        "Oracle averages within each true cluster, so each sum would run over one cluster and every client "
        "would learn which nodes share its cluster (it exchanges keys with exactly those); it is the reference "
        "told the true clusters: run it with secure-aggregation=none"
    )

    def __init__(self, inputs: StrategyInputs) -> None:
        super().__init__(inputs, [initial_weights(inputs) for _ in range(inputs.config.num_clusters)])
        self.assignment = dict(enumerate(inputs.true_clusters))

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: ClientManager) -> Any:
        # Oracle is told: from drift-round on, a drifting client is served (and averaged into) the cluster
        # whose data it now holds (fedcond.data.drift). Set before this round's fit and evaluate instructions.
        if self.inputs.config.drift_round:
            self.assignment = self.true_clusters_at(server_round)
        return super().configure_fit(server_round, parameters, client_manager)


IFCA_MODELS = Option(
    "ifca-models",
    0,
    "IFCA: K, the cluster models it trains; 0 = num-clusters (the true count, as the paper)",
    minimum=0,
)


def ifca_models(config: RunConfig) -> int:
    return IFCA_MODELS.of(config) or config.num_clusters


class IfcaStrategy(ClusterModels):
    """IFCA (Ghosh et al. 2020): K models, each client trains the one with its lowest training loss.

    Every round all K models go to every client (K times FedAvg's download); each client returns
    its trained choice, and each model becomes the sample-weighted average of the clients that chose
    it (a model nobody chose is kept). K = ``num-clusters``, models randomly initialised with
    distinct seeds, no restarts. Clients evaluate the model they chose last; a client that has not
    chosen yet (its training failed so far) receives all K and evaluates its lowest-loss one. The
    Adjusted Rand Index between choices and true clusters (from the server's scenario, never sent by a
    client) is recorded every round.
    """

    serves_held_out_clients = True  # a newcomer receives all K and takes its lowest-loss one
    options = (IFCA_MODELS,)
    secure_aggregation_refusal = (
        "IFCA's server groups the returned models by each client's choice, and a sum per choice would tell it "
        "every client's choice (its estimated cluster) and need each choice in the clear"
    )

    def __init__(self, inputs: StrategyInputs) -> None:
        seeds = [inputs.config.seed * 1000 + k for k in range(ifca_models(inputs.config))]
        super().__init__(inputs, [initial_weights(inputs, seed) for seed in seeds])

    @classmethod
    def check(cls, config: RunConfig) -> None:
        if ifca_models(config) < 2:
            raise FedcondError(
                "IFCA with one cluster model is FedAvg; give ifca-models=K (2 or more), the clusters it is to find "
                "(0: num-clusters)"
            )

    def instruction(
        self, stage: str, partition_id: int, current: Parameters, config: dict[str, Scalar]
    ) -> tuple[Parameters, dict[str, Scalar]]:
        if stage != FIT:
            return super().instruction(stage, partition_id, current, config)
        # Every client trains from the K models (it picks one). Evaluate-in-fit: it evaluates the one an
        # evaluate message would have brought (its last choice).
        if EVALUATE_FIRST in config and partition_id in self.assignment:
            config = {**config, EVALUATE_CHOICE: self.assignment[partition_id]}
        return self.all_models(), config

    def groups(self, server_round: int, results: list[tuple[int, FitRes]]) -> list[int]:
        choices = [int(res.metrics[CHOICE]) for _, res in results]
        if any(not 0 <= choice < len(self.models) for choice in choices):
            raise FedcondError("an IFCA client chose a model that does not exist; server and client disagree on K")
        self.assignment.update({partition: choice for (partition, _), choice in zip(results, choices, strict=True)})
        # Against the clusters whose data the clients hold this round: a drifted client choosing its
        # new cluster's model is right, not a mistake.
        truth_now = self.true_clusters_at(server_round)
        self.record_ari([truth_now[partition] for partition, _ in results], choices)
        return choices


DESCRIPTOR_EPS = Option(
    "descriptor-eps", 0.0,
    "descriptor clustering: DBSCAN's radius over the standardised descriptors; 0 = adaptive (the widest jump of "
    "the minimum spanning tree's edges, docs/baselines.md)",
    minimum=0,
)  # fmt: skip
DESCRIPTOR_MIN_SAMPLES = Option(
    "descriptor-min-samples", 2, "descriptor clustering: DBSCAN's min_samples (the client itself counts)", minimum=1
)


class DescriptorClusteringStrategy(ClusterModels):
    """Descriptor clustering in the style of FLUX (Fenoglio et al., NeurIPS 2025): before round 1 every
    client, newcomers included, sends a descriptor of its training data (``clients.descriptor_clustering``);
    the server clusters the training clients' descriptors with DBSCAN, which finds K itself
    (``fedcond.fingerprint.descriptor_clustering``), then runs FedAvg within each cluster found (as Oracle does within
    the true ones). A newcomer is served the model of the cluster whose centroid is nearest to its
    descriptor (FLUX's test-time assignment; label-free with ``fingerprint = "eigen-x"``). The clusters
    are found once: a drifting client keeps its cluster. FLUX's descriptors are latent means and
    covariances of a model being trained; ours are the run's fingerprint, the statistics Conditional is
    fed, so that the two ask the same question of the same numbers (docs/baselines.md). The Adjusted Rand
    Index against the true clusters (the server's scenario, never sent) is recorded every round.
    """

    serves_held_out_clients = True
    options = (DESCRIPTOR_EPS, DESCRIPTOR_MIN_SAMPLES)
    secure_aggregation_refusal = (
        "descriptor clustering's server clusters every client's descriptor, which it must see in the clear, "
        "and averages within each cluster it found"
    )

    def __init__(self, inputs: StrategyInputs) -> None:
        super().__init__(inputs, [])  # one model per cluster found, before round 1 (``set_up``, ``place``)
        self.found: DescriptorClusters | None = None

    @classmethod
    def check(cls, config: RunConfig) -> None:
        from fedcond.data.scenarios import scenario_kind
        from fedcond.fingerprint import fingerprints as fp
        from fedcond.privacy.dp import FINGERPRINT_EPSILON

        if not fp.fingerprint_spec(config.fingerprint).needs_data:
            raise FedcondError(
                f"descriptor clustering clusters what clients send about their data, and fingerprint "
                f"{config.fingerprint} describes none; choose a fingerprint computed from the data (eigen, eigen-x, "
                "class-mean, label-cov, class-eigen)"
            )
        if scenario_kind(config.scenario).labels_only:
            fp.check_label_free(config.fingerprint, config.scenario)
        if FINGERPRINT_EPSILON.of(config):
            raise FedcondError(
                "fingerprint-epsilon noises the fingerprint a Conditional client keeps to itself; descriptor "
                "clustering sends its descriptor unnoised: set fingerprint-epsilon=0"
            )

    def set_up(self, client_manager: ClientManager) -> None:
        config = self.inputs.config
        partitions = range(config.num_clients)  # newcomers too: each is placed by its own descriptor
        answers = ask_all([self.membership.node_of[pid] for pid in partitions], {STEP: STEP_DESCRIPTOR},
                          message_timeout(config))  # fmt: skip
        found = self.place([array_from_bytes(answer.get(DESCRIPTOR), DESCRIPTOR) for answer in answers])
        sizes = [found.labels.count(cluster) for cluster in range(found.count)]
        ari = self.record_found_ari()
        if self.inputs.recorder is not None:
            self.inputs.recorder.add_events("descriptor-clustering", [{
                "clusters": found.count, "sizes": sizes, "eps": found.eps, "noise": found.noise, "ari": ari,
                "descriptor_bytes": sum(len(answer[DESCRIPTOR]) for answer in answers),  # type: ignore[arg-type]
            }])  # fmt: skip
        if config.verbose:
            print(f"descriptor clustering: {found.count} cluster(s) of {sizes} clients (eps {found.eps:.3g}, "
                  f"{found.noise} noise), ARI {ari:.3f} against the true clusters")  # fmt: skip

    def place(self, descriptors: list[np.ndarray]) -> DescriptorClusters:
        """Cluster the training clients' descriptors (partition order) and place every client, newcomers
        (the partitions after them) at the nearest centroid."""
        config = self.inputs.config
        training = np.stack(descriptors[: config.num_training_clients])
        self.found = cluster_descriptors(training, DESCRIPTOR_EPS.of(config), DESCRIPTOR_MIN_SAMPLES.of(config))
        self.models = [initial_weights(self.inputs) for _ in range(self.found.count)]
        if self.server_momentum is not None:  # a FedAvgM stream per cluster found, each from zero
            self.server_momentum.reset(self.found.count)
        held_out = range(config.num_training_clients, config.num_clients)
        self.assignment = {
            **dict(enumerate(self.found.labels)), **{pid: self.found.assign(descriptors[pid]) for pid in held_out}
        }  # fmt: skip
        return self.found

    def record_found_ari(self) -> float:
        """The found clusters' ARI against the true ones, into every round's record (and returned)."""
        assert self.found is not None
        return self.record_ari(list(self.inputs.true_clusters[: self.inputs.config.num_training_clients]),
                               self.found.labels)  # fmt: skip

    def state(self) -> tuple[dict[str, Model], dict[str, Any]]:
        models, values = super().state()
        assert self.found is not None
        return models, {**values, "descriptor-clusters": self.found.as_json()}

    def load_state(self, models: dict[str, Model], values: dict[str, Any]) -> None:
        self.found = DescriptorClusters.from_json(values["descriptor-clusters"])
        self.models = [[] for _ in range(self.found.count)]  # filled by ClusterModels.load_state
        super().load_state(models, values)
        self.record_found_ari()
