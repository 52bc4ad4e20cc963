"""Descriptor clustering (FLUX-style): DBSCAN on the descriptors clients send once finds the clusters;
FedAvg within each."""

from strategies.cluster_models import DescriptorClusteringStrategy
from strategies.declaration import Declaration, Facts

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
    ),
    competitor=True,
)  # fmt: skip
