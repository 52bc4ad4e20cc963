"""``concat`` (the paper's): s is concatenated to the flattened conv features before the first FC layer.

s shifts the hidden pre-activations by a learned linear function of s: it can move units, but the
output layer is shared. Adds d x hidden parameters.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedcond.model.conditioning.base import Mechanism


class Concat(Mechanism):
    name = "concat"
    summary = "the paper's: [conv features || s] -> FC hidden"

    def first_layer_inputs(self, condition_dim: int) -> int:
        return condition_dim

    def logits(self, model: nn.Module, features: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        first, activation, head = model.classifier
        return head(activation(first(torch.cat([features, condition], dim=1))))

    def extra_parameters(self, condition_dim: int, hidden: int, num_classes: int, num_features: int = 0) -> int:
        return condition_dim * hidden

    def linear_blocks(self, model: nn.Module, update: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        # First FC layer: grad W[:, fingerprint columns] = e s^T and grad bias = e, summed over the batch.
        dim = model.condition_dim
        weight, bias = update["classifier.0.weight"], update["classifier.0.bias"]
        return weight[:, -dim:].T, bias


MECHANISM = Concat()
