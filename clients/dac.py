"""DAC's client: FedAvg's (train what you receive, return it), and DAC's rule for a newcomer."""

from __future__ import annotations

import numpy as np

from fedcond.federation.client import FedcondClient, evaluate_with, split_models
from fedcond.model.aggregation import DAC_NEIGHBOURS
from fedcond.model.networks import Network, set_weights
from fedcond.newcomers import lowest_loss_average


class DacClient(FedcondClient):
    """A training client is FedAvg's. A newcomer has no model to compare by cosine similarity, so it
    receives every training client's model and is served the uniform average of the ``dac-neighbours``
    with the lowest loss on its own training data: the similarity of Listo Zec et al.'s original DAC
    (the inverse of a peer model's training loss on the client's data), with the paper's top-k."""

    options = (DAC_NEIGHBOURS,)

    def newcomer_model(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Network:
        peers = split_models(parameters, self.model, self.run_config.method)
        losses = []
        for peer in peers:
            set_weights(self.model, peer)
            fit = evaluate_with(self.train_settings, self.model, self.data.train_x, self.data.train_y, None)
            losses.append(fit.loss)
        set_weights(self.model, lowest_loss_average(peers, losses, DAC_NEIGHBOURS.of(self.run_config)))
        return self.model


#: The class the ClientApp finds for this method by its name (fedcond.federation.client_app.client_class).
Client = DacClient
