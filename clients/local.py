"""Local: every client trains only its own model, kept in its state; nothing is sent or averaged."""

from __future__ import annotations

import numpy as np

from fedcond.federation.client import Evaluated, FedcondClient, Fitted
from fedcond.federation.messages import TRAIN_LOSS
from fedcond.model.networks import Network

LOCAL_MODEL = "local-model"


class LocalClient(FedcondClient):
    """Ignores what the server sends (nothing) and returns no weights."""

    state_lost_on_resume = "each client's own model (trained again from the initial model)"

    def own_model(self) -> Network:
        return self.kept.model(LOCAL_MODEL, self.fresh_model) or self.fresh_model()

    def train_round(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Fitted:
        model = self.own_model()
        loss = self.train_locally(model, round_config)
        self.kept.put_model(LOCAL_MODEL, model)
        return [], len(self.data.train_y), {TRAIN_LOSS: loss}

    def evaluate_round(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Evaluated:
        return self.evaluate_model(self.own_model(), round_config)

    def newcomer_model(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Network:
        return self.own_model()  # nobody else's: untrained until newcomer-steps train a copy


#: The class the ClientApp finds for this method by its name (fedcond.federation.client_app.client_class).
Client = LocalClient
