"""pFedHN's client (Shamsian et al. 2021): a training client trains the model its embedding generates
and returns it, as FedAvg's client does. A newcomer learns its own embedding with the hypernetwork
frozen: each step the server sends the model its current embedding generates, the newcomer takes one
SGD step on its own data and returns the result, and the server moves only the embedding
(``strategies.pfedhn``, ``fedcond.hypernetwork.NewcomerEmbedding``). The newcomer's evaluate message
then brings the zero-shot model (the mean embedding's) and the learned embedding's, scored as its
model after ``newcomer-steps`` steps."""

from __future__ import annotations

import dataclasses

import numpy as np

from clients.fedcond_client import Evaluated, FedcondClient, Fitted
from fedcond.errors import FedcondError
from fedcond.messages import (
    ACCURACY,
    ADAPTED_ACCURACY,
    NEWCOMER_STEP,
    STEP,
    STEP_NEWCOMER_EMBEDDING,
    TRAIN_LOSS,
    WITH_ADAPTED_MODEL,
)
from fedcond.models import get_weights, set_weights
from fedcond.newcomers import NEWCOMER_STEPS, step_indices
from fedcond.training import train


class PFedHNClient(FedcondClient):
    """FedAvg's client; a newcomer's embedding steps and its two-model evaluation (module docstring)."""

    def fit_instruction(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Fitted:
        if round_config.get(STEP) != STEP_NEWCOMER_EMBEDDING:
            return super().fit_instruction(parameters, round_config)
        if not self.is_newcomer:
            raise FedcondError("a training client was sent a newcomer's embedding step; server and client disagree")
        return self.embedding_step(parameters, round_config)

    def embedding_step(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Fitted:
        """One SGD step on batch ``NEWCOMER_STEP`` of the newcomer's seeded passes (``fedcond.newcomers``:
        the batches another method's newcomer takes its ``newcomer-steps`` steps on)."""
        steps, step = NEWCOMER_STEPS.of(self.run_config), int(round_config[NEWCOMER_STEP])  # type: ignore[arg-type]
        batch = self.train_settings.batch_size
        chosen = step_indices(len(self.data.train_y), steps, batch, self.round_seed(round_config))
        chosen = chosen[step * batch : (step + 1) * batch]
        set_weights(self.model, parameters)
        one_step = dataclasses.replace(self.train_settings, epochs=1)
        condition = self.condition(round_config)
        loss = train(self.model, self.data.train_x[chosen], self.data.train_y[chosen], condition, one_step,
                     self.round_seed(round_config))  # fmt: skip
        return get_weights(self.model), len(chosen), {TRAIN_LOSS: loss}

    def evaluate_newcomer(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Evaluated:
        if not round_config.get(WITH_ADAPTED_MODEL):  # zero-shot only (newcomer-steps = 0)
            set_weights(self.model, parameters)
            return self.evaluate_model(self.model, round_config)
        per_model = len(self.model.state_dict())
        if len(parameters) != 2 * per_model:
            raise FedcondError("a pFedHN newcomer expected two models; server and client disagree on the model")
        set_weights(self.model, parameters[per_model:])
        adapted = self.evaluate_model(self.model, round_config)[2][ACCURACY]
        set_weights(self.model, parameters[:per_model])
        loss, examples, metrics = self.evaluate_model(self.model, round_config)
        return loss, examples, {**metrics, ADAPTED_ACCURACY: adapted}
