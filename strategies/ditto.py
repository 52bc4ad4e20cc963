"""Ditto (Li et al. 2021): the server is FedAvg's; each client also keeps a personal model pulled
towards the global one."""

from fedcond.strategies.fedavg import FedcondFedAvg

from fedcond.federation.declaration import FEDAVG_COMMUNICATION, MODEL_REPLY, Declaration, Facts, Release

#: This method's one declaration: the method table finds it by this module's name.
METHOD = Declaration(
    "personal models pulled towards FedAvg's",
    FedcondFedAvg,
    Facts(
        "trains the global model (returned) and a personal model with loss + (lambda/2)·‖w \u2212 w_global‖²", "FedAvg",
        "personal model", FEDAVG_COMMUNICATION,
        "the global model (a newcomer has no personal model; `newcomer-steps` stands for its personal fine-tuning)",
        "`FedcondClient.newcomer_model`", "global",
        "keeps its personal model, trained on the old data, and goes on training it on the new",
        server_state=True,
        releases=(
            Release(
                "each training round",
                "the global model after local training, n and its training loss (its personal model never leaves it)",
                MODEL_REPLY.learns,
            ),
        ),
    ),
)  # fmt: skip
