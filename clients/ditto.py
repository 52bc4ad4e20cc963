"""Ditto (Li et al. 2021), alternating variant: a global model for FedAvg, a personal one kept locally."""

from __future__ import annotations

import dataclasses

import numpy as np

from fedcond.config import Option
from fedcond.federation.client import Evaluated, FedcondClient, Fitted
from fedcond.model.networks import set_weights
from fedcond.model.training import ProximalTerm

PERSONAL_MODEL = "ditto-personal-model"
LAMBDA = Option("ditto-lambda", 1.0, "Ditto: strength of the pull of the personal model to the global", minimum=0)
PERSONAL_EPOCHS = Option("ditto-personal-epochs", 5, "Ditto: local epochs of the personal model per round", minimum=1)


class DittoClient(FedcondClient):
    """Each round: train the personal model for ``ditto-personal-epochs`` on the task loss plus
    (lambda / 2) ||w - w_global||^2 (w_global: the global model as received), then train the global
    model as FedAvg does and return it. Evaluation uses the personal model.
    """

    options = (LAMBDA, PERSONAL_EPOCHS)
    state_lost_on_resume = "each client's personal model (trained again from the initial model)"

    def train_round(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Fitted:
        set_weights(self.model, parameters)
        personal = self.kept.model(PERSONAL_MODEL, self.fresh_model) or self.fresh_model()
        settings = dataclasses.replace(self.train_settings, epochs=PERSONAL_EPOCHS.of(self.run_config))
        proximal = ProximalTerm(anchor=self.model, strength=LAMBDA.of(self.run_config))
        self.train_locally(personal, round_config, settings, proximal)
        self.kept.put_model(PERSONAL_MODEL, personal)
        return super().train_round(parameters, round_config)

    def evaluate_round(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Evaluated:
        personal = self.kept.model(PERSONAL_MODEL, self.fresh_model)
        if personal is None:  # never trained (a held-out client, or before round 1): the global model
            return super().evaluate_round(parameters, round_config)
        return self.evaluate_model(personal, round_config)


#: The class the ClientApp finds for this method by its name (fedcond.federation.client_app.client_class).
Client = DittoClient
