"""IFCA (Ghosh et al. 2020): K cluster models; each client trains the one with the lowest loss on its data."""

from strategies.cluster_models import IfcaStrategy
from strategies.declaration import Declaration, Facts

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
    ),
)  # fmt: skip
