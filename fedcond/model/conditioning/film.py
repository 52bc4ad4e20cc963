"""``film``: s drives a feature-wise affine modulation of the FC hidden layer before its ReLU.

h -> (1 + gamma(s)) * h + beta(s), gamma and beta linear in s and zero at initialisation, so that
training starts from the unconditioned network. s can switch hidden units on and off per client.
Adds 2 (d x hidden + hidden) parameters.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedcond.model.conditioning.base import Mechanism, hidden_activations


class Film(Mechanism):
    name = "film"
    summary = "FiLM on the FC hidden layer: (1 + gamma(s)) h + beta(s)"

    def add_modules(self, model: nn.Module, condition_dim: int, hidden: int, num_classes: int) -> None:
        # Zero at initialisation: training starts from the unconditioned network and learns how far
        # each fingerprint direction should move each hidden unit.
        model.film = nn.Linear(condition_dim, 2 * hidden)
        nn.init.zeros_(model.film.weight)
        nn.init.zeros_(model.film.bias)

    def logits(self, model: nn.Module, features: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        head, hidden = hidden_activations(model, features)
        gamma, beta = model.film(condition).chunk(2, dim=1)
        return head(model.classifier[1]((1 + gamma) * hidden + beta))

    def extra_parameters(self, condition_dim: int, hidden: int, num_classes: int, num_features: int = 0) -> int:
        return 2 * (condition_dim * hidden + hidden)

    def linear_blocks(self, model: nn.Module, update: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        # The FiLM generator is a Linear fed s: grad weight = e s^T, grad bias = e.
        return update["film.weight"].T, update["film.bias"]


MECHANISM = Film()
