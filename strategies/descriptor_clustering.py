"""Descriptor clustering (FLUX-style): DBSCAN on the descriptors clients send once finds the clusters;
FedAvg within each."""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.server.client_manager import ClientManager

from fedcond.config import Option, RunConfig
from fedcond.errors import FedcondError
from fedcond.federation.cluster_models import ClusterModels
from fedcond.federation.declaration import IN_THE_CLEAR, MODEL_REPLY, Declaration, Facts, Release
from fedcond.federation.exchange import ask_all, message_timeout
from fedcond.federation.messages import (
    DESCRIPTOR,
    STEP,
    STEP_DESCRIPTOR,
    array_from_bytes,
)
from fedcond.federation.server_method import StrategyInputs, initial_weights
from fedcond.fingerprint.descriptor_clustering import DescriptorClusters, cluster_descriptors
from fedcond.model.aggregation import Model

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
    client, newcomers included, sends a descriptor of its training data (``fedcond.clients.descriptor_clustering``);
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
        answers = ask_all([self.protocol.membership.node_of[pid] for pid in partitions], {STEP: STEP_DESCRIPTOR},
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


#: This method's one declaration: the method table finds it by this module's name.
METHOD = Declaration(
    "one model per cluster DBSCAN finds in the clients' descriptors (K not given)",
    DescriptorClusteringStrategy,
    Facts(
        "sends its fingerprint once, before round 1; trains its cluster's model (FLUX-style; not in the paper)",
        "DBSCAN on the descriptors finds the clusters (K not given), FedAvg within each", "its cluster's model",
        "as FedAvg, plus one descriptor per client",
        "the model of the cluster whose centroid is nearest the descriptor it sends before round 1 (label-free with "
        "`fingerprint = \"eigen-x\"`; [baselines.md](baselines.md))", "`DescriptorClusteringStrategy.place`",
        "nearest descriptor",
        "keeps the cluster its descriptor placed it in before round 1 (descriptors are sent once)",
        server_state=True,
        releases=(
            Release(
                "before round 1",
                "its descriptor (`fingerprint`, e.g. the eigenvalues), as a vector",
                "the client's exact descriptor",
                IN_THE_CLEAR,
            ),
            MODEL_REPLY,
        ),
    ),
    competitor=True,
)  # fmt: skip
