"""``hyper``: s generates the output layer, a linear hypernetwork over the last layer.

logits = (W0 + sum_j s_j W_j) h + (b0 + sum_j s_j b_j): clients with different s get different
heads, which is what a label permutation requires. Adds d x classes x (hidden + 1) parameters.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from fedcond.model.conditioning.base import Mechanism

#: The output layer's arrays in a hyper-conditioned model: the shared head W0, b0 (``classifier[2]``)
#: and the generated blocks W_j | b_j, one per fingerprint dimension.
HEAD_WEIGHT, HEAD_BIAS, GENERATOR = "classifier.2.weight", "classifier.2.bias", "hyper.weight"


def head_of(weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """An output layer as one (classes, hidden + 1) array [W | b], the layout of a generated block."""
    return np.concatenate([weight, bias[:, None]], axis=1)


class HyperHead(nn.Module):
    """The generated part of the output layer: W_j, b_j for every fingerprint dimension j in
    ``weight`` (condition_dim, classes, hidden + 1), added to the base head's logits.

    A module of its own (not a bare parameter of the network) so that Opacus can compute its
    per-sample gradients (``register_grad_samplers``); ``base`` is an input, not a sum taken
    outside, so the logits are computed in the same order as always.
    """

    def __init__(self, initial: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(initial)

    def forward(self, condition: torch.Tensor, hidden: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        generated = torch.einsum("bj,jco->bco", condition, self.weight)  # (batch, classes, hidden + 1)
        weights, biases = generated[..., :-1], generated[..., -1]
        return base + torch.einsum("bco,bo->bc", weights, hidden) + biases


class Hyper(Mechanism):
    name = "hyper"
    summary = "s generates the output layer (a linear hypernetwork over the head)"

    def add_modules(self, model: nn.Module, condition_dim: int, hidden: int, num_classes: int) -> None:
        # W0, b0 is classifier[2]; W_j, b_j for every fingerprint dimension j live here, small
        # enough that sum_j s_j W_j starts at the scale of W0 for a z-scored s; or zero
        # (hyper-init=zero): every client starts from the shared head W0, b0. The noise is drawn
        # either way, so that the generator's later draws do not depend on the choice.
        scale = 1.0 / np.sqrt(hidden * condition_dim)
        initial = torch.randn(condition_dim, num_classes, hidden + 1) * scale
        model.hyper = HyperHead(torch.zeros_like(initial) if model.hyper_init == "zero" else initial)

    def logits(self, model: nn.Module, features: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        first, activation, head = model.classifier
        hidden = activation(first(features))
        return model.hyper(condition, hidden, head(hidden))

    def extra_parameters(self, condition_dim: int, hidden: int, num_classes: int, num_features: int = 0) -> int:
        return condition_dim * num_classes * (hidden + 1)

    def linear_blocks(self, model: nn.Module, update: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        # W_j is multiplied by s_j where the base head W0 | b0 is multiplied by 1: grad W_j = s_j grad [W0 | b0].
        head = head_of(update[HEAD_WEIGHT], update[HEAD_BIAS])
        return update[GENERATOR].reshape(model.condition_dim, -1), head.ravel()

    @functools.cache  # noqa: B019 (one mechanism object for the process)
    def register_grad_samplers(self) -> None:
        from opacus.grad_sample import register_grad_sampler

        @register_grad_sampler(HyperHead)
        def _hyper_head_grad_sample(
            layer: HyperHead, activations: list[torch.Tensor], backprops: torch.Tensor
        ) -> dict[nn.Parameter, torch.Tensor]:
            # d logits_bc / d W_jck = s_bj [h_b || 1]_k: the per-sample gradient is an outer product.
            condition, hidden = (activation.to(backprops.dtype) for activation in activations[:2])
            augmented = torch.cat([hidden, torch.ones_like(hidden[:, :1])], dim=1)
            return {layer.weight: torch.einsum("bj,bc,bk->bjck", condition, backprops, augmented)}


MECHANISM = Hyper()
