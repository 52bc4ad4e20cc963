"""IFCA (Ghosh et al. 2020): pick the cluster model with the lowest training loss, train it, return it."""

from __future__ import annotations

import numpy as np

from fedcond.federation.client import Evaluated, FedcondClient, Fitted, evaluate_with, split_models
from fedcond.federation.messages import CHOICE, EVALUATE_CHOICE, TRAIN_LOSS
from fedcond.model.aggregation import lowest_loss_choice
from fedcond.model.networks import Network, get_weights, set_weights


class IfcaClient(FedcondClient):
    """Receives all K models concatenated; evaluates each on its own training data, trains the best.

    Evaluation rounds receive only the model the client chose (the server remembers the choice);
    a client that has not chosen yet (its training failed so far) receives all K and evaluates the
    one it would choose.
    """

    released_beyond_training = "the choice of the model with the lowest loss on their training data"

    def choose(self, candidates: list[list[np.ndarray]], round_config: dict[str, object]) -> int:
        """IFCA's cluster identity step: the candidate with the lowest loss on this client's training data."""
        losses = []
        for candidate in candidates:
            set_weights(self.model, candidate)
            fit = evaluate_with(
                self.train_settings, self.model, self.data.train_x, self.data.train_y, self.condition(round_config)
            )
            losses.append(fit.loss)
        return lowest_loss_choice(losses)

    def train_round(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Fitted:
        candidates = split_models(parameters, self.model, self.run_config.method)
        choice = self.choose(candidates, round_config)
        set_weights(self.model, candidates[choice])
        loss = self.train_locally(self.model, round_config)
        metrics = {TRAIN_LOSS: loss, CHOICE: choice}
        return get_weights(self.model), len(self.data.train_y), metrics

    def evaluate_received(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Evaluated:
        # A training instruction brings all K models; the evaluate message would have brought only the
        # last choice, which the server names (``EVALUATE_CHOICE``; none yet: the one it would choose).
        if EVALUATE_CHOICE not in round_config:
            return self.evaluate_round(parameters, round_config)
        set_weights(
            self.model, split_models(parameters, self.model, self.run_config.method)[int(round_config[EVALUATE_CHOICE])]
        )  # type: ignore[arg-type]
        return self.evaluate_model(self.model, round_config)

    def newcomer_model(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Network:
        """IFCA's cluster identity step for a newcomer: the K models' lowest loss on its training data."""
        candidates = split_models(parameters, self.model, self.run_config.method)
        set_weights(self.model, candidates[self.choose(candidates, round_config)])
        return self.model

    def evaluate_round(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Evaluated:
        candidates = split_models(parameters, self.model, self.run_config.method)
        chosen = candidates[self.choose(candidates, round_config)] if len(candidates) > 1 else candidates[0]
        set_weights(self.model, chosen)
        return self.evaluate_model(self.model, round_config)


#: The class the ClientApp finds for this method by its name (fedcond.federation.client_app.client_class).
Client = IfcaClient
