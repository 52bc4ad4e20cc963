"""FedBN (Li et al., ICLR 2021): the server is FedAvg's; each client keeps its batch-norm layers."""

from __future__ import annotations

from fedcond.strategies.fedavg import FedcondFedAvg

from fedcond.config import RunConfig
from fedcond.data.datasets import dataset_spec
from fedcond.errors import FedcondError
from fedcond.federation.declaration import FEDAVG_COMMUNICATION, Declaration, Facts, Release
from fedcond.model.networks import has_batch_norm


class FedBNStrategy(FedcondFedAvg):
    """FedAvg's server, averaging every array: each client puts its own batch-norm layers back in
    place of the averaged ones (``clients/fedbn.py``), so the averaged layers serve only a newcomer,
    which recomputes their statistics. (The paper's server leaves them out of the average; what the
    clients train with is the same, and the bytes sent are FedAvg's.)"""

    @classmethod
    def check(cls, config: RunConfig) -> None:
        super().check(config)
        if not has_batch_norm(dataset_spec(config.dataset).input_shape) or config.feature_norm != "batch":
            raise FedcondError(
                f"fedbn keeps each client's batch-norm layers, and this run's network has none ({config.dataset}, "
                f"feature-norm={config.feature_norm}): use cifar10 or cifar100 with feature-norm=batch, or fedavg "
                "(which FedBN is without batch norm)"
            )


#: This method's one declaration: the method table finds it by this module's name.
METHOD = Declaration(
    "FedAvg with each client's batch-norm layers kept by the client",
    FedBNStrategy,
    Facts(
        "trains the global model with its own batch-norm layers in place of the averaged ones, and keeps them "
        "(Li et al. 2021; not in the paper)", "FedAvg (sample-weighted)", "global model + own batch-norm layers",
        FEDAVG_COMMUNICATION,
        "the global model, its batch-norm statistics recomputed on the newcomer's own unlabelled training images "
        "(AdaBN)", "`FedcondClient.newcomer_model`", "global",
        "keeps its own batch-norm layers and goes on training them on the new data", server_state=True,
        releases=(
            Release(
                "each training round",
                "the model after local training, its own batch-norm layers included (affine parameters and running "
                "means and variances), n and its training loss",
                "the client's model update, and its features' per-channel means and variances (statistics of its "
                "data)",
            ),
        ),
    ),
    competitor=True,
    test_settings={"dataset": "cifar10", "local-epochs": 2, "batch-size": 8},
)  # fmt: skip
