"""pFedHN's client (Shamsian et al. 2021): a training client trains the model its embedding generates
and returns it, as FedAvg's client does. A newcomer learns its own embedding with the hypernetwork
frozen: each step the server sends the model its current embedding generates, the newcomer takes one
SGD step on its own data and returns the result, and the server moves only the embedding
(``fedcond.strategies.pfedhn``, ``fedcond.model.hypernetwork.NewcomerEmbedding``). The newcomer's evaluate message
then brings the zero-shot model (the mean embedding's) and the learned embedding's, scored as its
model after ``newcomer-steps`` steps."""

from __future__ import annotations

import numpy as np

from fedcond.errors import FedcondError
from fedcond.federation.client import Evaluated, FedcondClient, Fitted
from fedcond.federation.messages import (
    ACCURACY,
    ADAPTED_ACCURACY,
    NEWCOMER_STEP,
    PAYLOAD_PARTS,
    PFEDHN_NEWCOMER_PARTS,
    STEP,
    STEP_NEWCOMER_EMBEDDING,
    TRAIN_LOSS,
    unpack_parts,
)
from fedcond.model.networks import get_weights, set_weights


class PFedHNClient(FedcondClient):
    """FedAvg's client; a newcomer's embedding steps and its two-model evaluation (module docstring)."""

    def fit_instruction(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Fitted:
        if round_config.get(STEP) != STEP_NEWCOMER_EMBEDDING:
            return super().fit_instruction(parameters, round_config)
        if not self.is_newcomer:
            raise FedcondError("a training client was sent a newcomer's embedding step; server and client disagree")
        return self.embedding_step(parameters, round_config)

    def embedding_step(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Fitted:
        """One SGD step on batch ``NEWCOMER_STEP`` of the newcomer's seeded batches (the samples another
        method's newcomer takes its ``newcomer-steps`` steps on)."""
        set_weights(self.model, parameters)
        loss = self.train_newcomer_steps(self.model, round_config, int(round_config[NEWCOMER_STEP]), 1)  # type: ignore[arg-type]
        return get_weights(self.model), self.train_settings.batch_size, {TRAIN_LOSS: loss}

    def evaluate_newcomer(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Evaluated:
        if PAYLOAD_PARTS not in round_config:  # zero-shot only (newcomer-steps = 0)
            set_weights(self.model, parameters)
            return self.evaluate_model(self.model, round_config)
        models = unpack_parts(parameters, round_config[PAYLOAD_PARTS], PFEDHN_NEWCOMER_PARTS)
        zero_shot, learned = (models[name] for name in PFEDHN_NEWCOMER_PARTS)
        set_weights(self.model, learned)
        adapted = self.evaluate_model(self.model, round_config)[2][ACCURACY]
        set_weights(self.model, zero_shot)
        loss, examples, metrics = self.evaluate_model(self.model, round_config)
        return loss, examples, {**metrics, ADAPTED_ACCURACY: adapted}


#: The class the ClientApp finds for this method by its name (fedcond.federation.client_app.client_class).
Client = PFedHNClient
