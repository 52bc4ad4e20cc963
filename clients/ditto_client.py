"""Ditto (Li et al. 2021), alternating variant: a global model for FedAvg, a personal one kept locally."""

from __future__ import annotations

import dataclasses

import numpy as np

from clients.numpy_client import FedcondClient
from fedcond.models import set_weights
from fedcond.training import ProximalTerm

PERSONAL_MODEL = "ditto-personal-model"


class DittoClient(FedcondClient):
    """Each round: train the personal model for ``ditto-personal-epochs`` on the task loss plus
    (lambda / 2) ||w - w_global||^2 (w_global: the global model as received), then train the global
    model as FedAvg does and return it. Evaluation uses the personal model.
    """

    def train_round(
        self, parameters: list[np.ndarray], config: dict[str, object]
    ) -> tuple[list[np.ndarray], int, dict[str, object]]:
        set_weights(self.model, parameters)
        personal = self.stored_model(PERSONAL_MODEL) or self.fresh_model()
        settings = dataclasses.replace(self.train_settings, epochs=self.config.ditto_personal_epochs)
        proximal = ProximalTerm(anchor=self.model, strength=self.config.ditto_lambda)
        self.train_locally(personal, config, settings, stream=1, proximal=proximal)
        self.store_model(PERSONAL_MODEL, personal)
        return super().train_round(parameters, config)

    def evaluate_round(
        self, parameters: list[np.ndarray], config: dict[str, object]
    ) -> tuple[float, int, dict[str, object]]:
        personal = self.stored_model(PERSONAL_MODEL)
        if personal is None:  # evaluated before any training: the personal model starts as the global one
            return super().evaluate_round(parameters, config)
        return self.evaluate_model(personal, config)
