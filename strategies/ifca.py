"""IFCA (Ghosh et al. 2020): K cluster models; each client trains the one with the lowest loss on its data."""

from __future__ import annotations

from flwr.common import FitRes, Parameters, Scalar

from fedcond.config import Option, RunConfig
from fedcond.errors import FedcondError
from fedcond.federation.cluster_models import ClusterModels
from fedcond.federation.declaration import Declaration, Facts, Release
from fedcond.federation.messages import (
    CHOICE,
    EVALUATE_CHOICE,
    EVALUATE_FIRST,
)
from fedcond.federation.participation import FIT
from fedcond.federation.server_method import StrategyInputs, initial_weights

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


#: This method's one declaration: the method table finds it by this module's name.
METHOD = Declaration(
    "K models, each client trains its lowest-loss one",
    IfcaStrategy,
    Facts(
        "evaluates all K models on its training data, trains the lowest-loss one",
        "each model = average of the clients that chose it", "the model it chose", "K models down, 1 up",
        "all K cluster models; it takes the one with the lowest loss on its training data (IFCA's cluster identity "
        "step)", "`IfcaClient.newcomer_model`", "lowest-loss cluster",
        "re-selects: every round it takes the cluster model with the lowest loss on the data it now holds",
        server_state=True,
        releases=(
            Release(
                "each training round",
                "the model it trained, which of the K models it chose, n and its training loss",
                "the client's model update and its estimated cluster (its choice)",
            ),
        ),
    ),
)  # fmt: skip
