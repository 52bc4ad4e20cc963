"""``ens`` (the appendix's Ens): ``ensemble-size`` linear models blended by softmax weights of s.

y = sum_k softmax(G s + g)_k (W_k x + b_k): a mixture of experts whose gate reads only the
fingerprint, so every client gets one fixed blend of the experts, a soft cluster assignment. The
gate starts at zero (an even blend); the experts start from independent seeded initialisations,
which is what lets them specialise.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedcond.conditioning.tabular_base import TabularMechanism

DEFAULT_ENSEMBLE_SIZE = 8  # Table VII's clusters: the most the appendix's tasks need


class Ens(TabularMechanism):
    name = "ens"
    summary = "the appendix's Ens (tabular): ensemble-size linear experts blended by softmax(G s + g)"

    def add_modules(self, model: nn.Module, condition_dim: int, hidden: int, num_classes: int) -> None:
        model.experts = nn.Linear(model.num_features, model.ensemble_size * num_classes)
        model.gate = nn.Linear(condition_dim, model.ensemble_size)
        nn.init.zeros_(model.gate.weight)
        nn.init.zeros_(model.gate.bias)

    def logits(self, model: nn.Module, features: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        blend = torch.softmax(model.gate(condition), dim=1)  # (batch, experts)
        outputs = model.experts(features).view(len(features), model.ensemble_size, -1)  # (batch, experts, classes)
        return torch.einsum("bk,bkc->bc", blend, outputs)

    def extra_parameters(self, condition_dim: int, hidden: int, num_classes: int, num_features: int = 0) -> int:
        # Counted for the default ensemble-size; model.ensemble_size experts in general.
        experts = DEFAULT_ENSEMBLE_SIZE
        total = experts * (num_features + 1) * num_classes + (condition_dim + 1) * experts
        return total - self.plain_parameters(num_features, num_classes)

    def linear_blocks(self, model: nn.Module, update: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        # The gate is a Linear fed s: grad weight = e s^T, grad bias = e.
        return update["gate.weight"].T, update["gate.bias"]


MECHANISM = Ens()
