"""``feature-norm=local-batch``: each client keeps its own batch-norm layers (FedBN), and a client that
never trained recomputes their statistics on its own training images (AdaBN).

FedBN (Li et al., ICLR 2021) leaves the batch-norm layers out of the average: the conv and FC weights
are shared, each client's feature statistics and affine parameters stay its own, so a covariate
cluster is normalised by its own statistics instead of the federation's mixture. The server still
averages every array (what it sends is the shared model); a client replaces the batch-norm entries
of what it receives with its own before it trains or evaluates. A newcomer has no layers of its own:
it takes the averaged affine parameters and recomputes the running statistics from its own unlabelled
training images (AdaBN, Li et al. 2016), before it is scored.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedcond.model.device import pick_device
from fedcond.model.training import EVAL_BATCH, laid_out, set_layout

BATCH_NORM = nn.modules.batchnorm._BatchNorm


def local_state_names(model: nn.Module) -> list[str]:
    """The ``state_dict`` entries of the model's batch-norm layers: weight, bias and statistics."""
    prefixes = [f"{name}." for name, module in model.named_modules() if isinstance(module, BATCH_NORM)]
    return [name for name in model.state_dict() if any(name.startswith(prefix) for prefix in prefixes)]


def local_state(model: nn.Module) -> list[np.ndarray]:
    """This client's batch-norm entries, in ``local_state_names`` order."""
    state = model.state_dict()
    return [state[name].detach().cpu().numpy().copy() for name in local_state_names(model)]


def load_local_state(model: nn.Module, arrays: list[np.ndarray]) -> None:
    """Put a client's own batch-norm entries (``local_state``) into ``model`` in place of the received ones."""
    state = model.state_dict()
    for name, array in zip(local_state_names(model), arrays, strict=True):
        state[name].copy_(torch.from_numpy(np.asarray(array)))


@torch.no_grad()
def recompute_statistics(model: nn.Module, images: np.ndarray, channels_last: bool = False) -> None:
    """AdaBN: every batch-norm layer's running mean and variance recomputed as the exact averages over
    ``images`` (batches of ``EVAL_BATCH``), the affine parameters and every other weight untouched."""
    layers = [module for module in model.modules() if isinstance(module, BATCH_NORM)]
    if not layers:
        return
    device = pick_device()
    model.to(device)
    set_layout(model, channels_last)
    momenta = [layer.momentum for layer in layers]
    for layer in layers:
        layer.reset_running_stats()
        layer.momentum = None  # a cumulative average over the batches, not an exponential one
        layer.train()
    try:
        for start in range(0, len(images), EVAL_BATCH):
            batch = torch.from_numpy(np.ascontiguousarray(images[start : start + EVAL_BATCH])).to(device)
            model.features(laid_out(batch, channels_last))
    finally:
        for layer, momentum in zip(layers, momenta, strict=True):
            layer.momentum = momentum
        model.eval()
