"""Oracle: FedAvg within each true cluster, the reference no real method can be (the server reads the
clusters from its own scenario)."""

from strategies.cluster_models import OracleStrategy
from strategies.declaration import FEDAVG_COMMUNICATION, Declaration, Facts

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
    ),
)  # fmt: skip
