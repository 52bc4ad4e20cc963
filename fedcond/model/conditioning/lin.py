"""``lin`` (the appendix's Lin): s generates the weights of a linear model, y = x^T (W s + b).

One Linear layer maps s to every output's weights over the features and its bias: the features are
multiplied element-wise by a learned linear projection of s (the appendix's y = x^T W mu), plus
the projection's own bias b, which is the linear model every client shares (our addition: without
it a client whose s is 0 after the z-score would have no model at all). W starts at zero: training
starts from one shared linear model and learns how each fingerprint direction changes it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedcond.model.conditioning.tabular_base import TabularMechanism


class Lin(TabularMechanism):
    name = "lin"
    summary = "the appendix's Lin (tabular): s generates a linear model's weights, y = x^T (W s + b)"

    def add_modules(self, model: nn.Module, condition_dim: int, hidden: int, num_classes: int) -> None:
        features = model.num_features
        model.lin = nn.Linear(condition_dim, num_classes * (features + 1))
        shared = nn.Linear(features, num_classes)  # the plain model's initialisation, as b
        with torch.no_grad():
            model.lin.weight.zero_()
            model.lin.bias.copy_(torch.cat([shared.weight, shared.bias[:, None]], dim=1).ravel())

    def logits(self, model: nn.Module, features: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        generated = model.lin(condition).view(len(features), -1, model.num_features + 1)  # (batch, outputs, D + 1)
        return torch.einsum("bcd,bd->bc", generated[..., :-1], features) + generated[..., -1]

    def extra_parameters(self, condition_dim: int, hidden: int, num_classes: int, num_features: int = 0) -> int:
        total = (condition_dim + 1) * num_classes * (num_features + 1)
        return total - self.plain_parameters(num_features, num_classes)

    def linear_blocks(self, model: nn.Module, update: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        # The generator is a Linear fed s: grad weight = e s^T, grad bias = e.
        return update["lin.weight"].T, update["lin.bias"]


MECHANISM = Lin()
