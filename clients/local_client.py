"""Local: every client trains only its own model, kept in its state; nothing is sent or averaged."""

from __future__ import annotations

import numpy as np

from clients.numpy_client import FedcondClient
from fedcond.protocol import TRAIN_LOSS

LOCAL_MODEL = "local-model"


class LocalClient(FedcondClient):
    """Ignores what the server sends (nothing) and returns no weights."""

    def own_model(self):
        return self.stored_model(LOCAL_MODEL) or self.fresh_model()

    def train_round(
        self, parameters: list[np.ndarray], config: dict[str, object]
    ) -> tuple[list[np.ndarray], int, dict[str, object]]:
        model = self.own_model()
        loss = self.train_locally(model, config)
        self.store_model(LOCAL_MODEL, model)
        return [], len(self.data.train_y), {**self.identity_metrics(), TRAIN_LOSS: loss}

    def evaluate_round(
        self, parameters: list[np.ndarray], config: dict[str, object]
    ) -> tuple[float, int, dict[str, object]]:
        return self.evaluate_model(self.own_model(), config)
