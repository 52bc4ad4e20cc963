"""FedProx (Li et al. 2020): the server is FedAvg's; each client's training is pulled towards the model it received."""

from fedcond.strategies.fedavg import FedcondFedAvg

from fedcond.federation.declaration import (
    FEDAVG_COMMUNICATION,
    GLOBAL_NEWCOMER,
    MODEL_REPLY,
    NOTHING_ON_DRIFT,
    Declaration,
    Facts,
)

#: This method's one declaration: the method table finds it by this module's name.
METHOD = Declaration(
    "FedAvg with each client's training pulled towards the global model",
    FedcondFedAvg,
    Facts(
        "trains the global model with loss + (mu/2)·‖w \u2212 w_global‖² (Li et al. 2020; not in the paper)", "FedAvg",
        "global model", FEDAVG_COMMUNICATION, *GLOBAL_NEWCOMER, NOTHING_ON_DRIFT, server_state=True,
        releases=(
            MODEL_REPLY,
        ),
    ),
    competitor=True,
)  # fmt: skip
