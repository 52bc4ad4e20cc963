"""``ens`` (the appendix's Ens): ``ensemble-size`` models blended by softmax weights of s.

y = sum_k softmax(G s + g)_k f_k(x): a mixture of experts whose gate reads only the fingerprint, so
every client gets one fixed blend of the experts, a soft cluster assignment. The gate starts at
zero (an even blend); the experts start from independent seeded initialisations, which is what lets
them specialise.

- On a tabular model the experts are linear models, W_k x + b_k (the appendix's), and the mechanism
  builds the whole network.
- On a CNN they are output layers over the shared FC hidden layer (a mixture of heads), expert k's
  head W0 + D_k: the backbone's own head W0 shared, each D_k starting as small seeded noise (a
  tenth of a layer's initial scale). The client's head is W0 + sum_k pi_k D_k, the plain network at
  the start; the conv stack and hidden layer keep their seeded weights. Blending eight heads of full
  initial scale instead averaged their logits towards zero and gave each an eighth of the gradient:
  on digits E3b that loss stayed at chance (2.30) for 15 rounds.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedcond.model.conditioning.base import hidden_activations
from fedcond.model.conditioning.tabular_base import TabularMechanism

DEFAULT_ENSEMBLE_SIZE = 8  # Table VII's clusters: the most the appendix's tasks need
CORRECTION_SCALE = 0.1  # a CNN expert's head correction D_k, relative to a layer's initial scale


def _on_cnn(model: nn.Module) -> bool:
    """A CNN (or any model with the FC hidden layer and head) rather than a tabular model's own network."""
    return hasattr(model, "features")


class Ens(TabularMechanism):
    name = "ens"
    summary = "the appendix's Ens: ensemble-size experts (linear models; a CNN's heads) blended by softmax(G s + g)"

    def add_modules(self, model: nn.Module, condition_dim: int, hidden: int, num_classes: int) -> None:
        if _on_cnn(model):
            model.heads = nn.Linear(hidden, model.ensemble_size * num_classes)
            with torch.no_grad():
                model.heads.weight.mul_(CORRECTION_SCALE)
                model.heads.bias.mul_(CORRECTION_SCALE)
        else:
            model.experts = nn.Linear(model.num_features, model.ensemble_size * num_classes)
        model.gate = nn.Linear(condition_dim, model.ensemble_size)
        nn.init.zeros_(model.gate.weight)
        nn.init.zeros_(model.gate.bias)

    def logits(self, model: nn.Module, features: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        blend = torch.softmax(model.gate(condition), dim=1)  # (batch, experts)
        if _on_cnn(model):
            head, hidden = hidden_activations(model, features)
            hidden = model.classifier[1](hidden)
            corrections = model.heads(hidden).view(len(features), model.ensemble_size, -1)
            return head(hidden) + torch.einsum("bk,bkc->bc", blend, corrections)
        outputs = model.experts(features).view(len(features), model.ensemble_size, -1)  # (batch, experts, classes)
        return torch.einsum("bk,bkc->bc", blend, outputs)

    def extra_parameters(self, condition_dim: int, hidden: int, num_classes: int, num_features: int = 0) -> int:
        # Counted for the default ensemble-size; model.ensemble_size experts in general. A CNN's
        # (num_features 0) over its backbone, a tabular model's over the plain linear model.
        experts, gate = DEFAULT_ENSEMBLE_SIZE, (condition_dim + 1) * DEFAULT_ENSEMBLE_SIZE
        if not num_features:
            return experts * (hidden + 1) * num_classes + gate
        return experts * (num_features + 1) * num_classes + gate - self.plain_parameters(num_features, num_classes)

    def linear_blocks(self, model: nn.Module, update: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        # The gate is a Linear fed s: grad weight = e s^T, grad bias = e.
        return update["gate.weight"].T, update["gate.bias"]


MECHANISM = Ens()
