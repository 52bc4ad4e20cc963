"""Oracle: FedAvg within each true cluster, the reference no real method can be (the server reads the
clusters from its own scenario)."""

from __future__ import annotations

from fedcond.federation.cluster_models import ClusterModels
from fedcond.federation.declaration import FEDAVG_COMMUNICATION, MODEL_REPLY, Declaration, Facts
from fedcond.federation.server_method import StrategyInputs, initial_weights


class OracleStrategy(ClusterModels):
    """Oracle: FedAvg within each true cluster, one model per cluster.

    Oracle is the reference that is told the true clusters: its server reads each partition's cluster
    from the simulation's scenario (ground truth no client sends, and no real method could know). It
    shows what perfect clustering achieves; it is not a competitor. A held-out client evaluates its
    true cluster's model.
    """

    serves_held_out_clients = True
    uses_true_clusters = True
    # Its groups are the scenario's true clusters, which no client sends: client-level DP noises each
    # cluster's mean, and a client's data reaches only its own cluster's.
    client_dp_per_model = True
    secure_aggregation_refusal = (
        "Oracle averages within each true cluster, so each sum would run over one cluster and every client "
        "would learn which nodes share its cluster (it exchanges keys with exactly those); it is the reference "
        "told the true clusters: run it with secure-aggregation=none"
    )

    def __init__(self, inputs: StrategyInputs) -> None:
        super().__init__(inputs, [initial_weights(inputs) for _ in range(inputs.config.num_clusters)])
        self.assignment = dict(enumerate(inputs.true_clusters))

    def start_round(self, server_round: int) -> None:
        # Oracle is told: from drift-round on, a drifting client is served (and averaged into) the cluster
        # whose data it now holds (fedcond.data.drift). Set before this round's fit and evaluate instructions.
        if self.inputs.config.drift_round:
            self.assignment = self.true_clusters_at(server_round)


#: This method's one declaration: the method table finds it by this module's name.
METHOD = Declaration(
    "FedAvg within each true cluster (reference)",
    OracleStrategy,
    Facts(
        "trains its cluster's model", "FedAvg within each **true** cluster (a reference, not a competitor)",
        "its cluster's model", FEDAVG_COMMUNICATION,
        "its true cluster's model (the reference: no real method knows the cluster)",
        "`OracleStrategy.instruction`", "true cluster",
        "is told: from round D it serves, and averages into, the model of the cluster whose data the client now holds",
        server_state=True,
        releases=(
            MODEL_REPLY,
        ),
    ),
)  # fmt: skip
