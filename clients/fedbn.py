"""FedBN (Li et al., ICLR 2021, "FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization"): FedAvg whose clients keep their own batch-norm layers."""

from __future__ import annotations

from fedcond.federation.client import FedcondClient


class FedBNClient(FedcondClient):
    """Trains the global model with its own batch-norm layers (affine parameters and running
    statistics) in place of the averaged ones, and keeps them for its next round: a client's features
    are normalised by its own statistics, not the federation's mixture. In its first round it has
    none yet and trains the received ones. A newcomer recomputes the statistics on its own unlabelled
    training images before it is scored (AdaBN, ``FedcondClient.newcomer_model``)."""

    state_lost_on_resume = "each client's own batch-norm layers (taken again from the global model, then kept)"

    always_keeps_local_norm = True


#: The class the ClientApp finds for this method by its name (fedcond.federation.client_app.client_class).
Client = FedBNClient
