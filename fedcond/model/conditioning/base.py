"""What every conditioning mechanism provides (``fedcond.model.conditioning`` lists them).

The network is a ``fedcond.model.networks.ConditionalCNN`` or a ``TabularModel`` (typed ``nn.Module`` here: that
module builds on this one).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class Mechanism:
    """How a ``ConditionalCNN`` (conv features -> FC hidden -> ReLU -> FC classes), or a tabular model's
    MLP (features -> FC hidden -> ReLU -> FC outputs), takes s.

    The network's ``classifier`` is (first FC, ReLU, head); subclasses override what differs.
    """

    name: str = ""
    summary: str = ""
    #: False: it conditions the model's FC hidden layer and head (a CNN's, a tabular model's MLP);
    #: True: it builds the whole conditioned network itself (``fedcond.model.conditioning.tabular_base``).
    builds_own_model: bool = False

    def first_layer_inputs(self, condition_dim: int) -> int:
        """Fingerprint values the first FC layer takes beside the conv features (0: none)."""
        return 0

    def add_modules(self, model: nn.Module, condition_dim: int, hidden: int, num_classes: int) -> None:
        """Attach the mechanism's own modules to ``model`` (after the backbone is built)."""

    def logits(self, model: nn.Module, features: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_parameters(self, condition_dim: int, hidden: int, num_classes: int, num_features: int = 0) -> int:
        """Parameters the mechanism adds to the unconditioned backbone (``num_features``: a tabular model's)."""
        raise NotImplementedError

    def linear_blocks(self, model: nn.Module, update: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(P, Q): the update of the block linear in s, shaped (d, k), and of its companion, shaped
        (k,), so that P = s Q^T for one client's update (``fedcond.privacy.attack``)."""
        raise NotImplementedError

    def register_grad_samplers(self) -> None:
        """Teach Opacus the per-sample gradients of the mechanism's own layers (none: standard layers)."""


def hidden_activations(model: nn.Module, features: torch.Tensor) -> tuple[nn.Module, torch.Tensor]:
    """The head and the FC hidden layer's pre-activation output of the plain backbone."""
    first, _, head = model.classifier
    return head, first(features)
