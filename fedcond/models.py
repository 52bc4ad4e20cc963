"""The backbone CNNs, optionally conditioned on the client fingerprint.

Conditioning follows the paper: the fingerprint is concatenated to the flattened conv features
before the first fully connected layer. With ``condition_dim=0`` the same network is the plain
backbone every baseline uses, so methods differ only in what they do, not in capacity.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedcond.config import RunConfig
from fedcond.errors import FedcondError


def small_features(channels: int) -> nn.Sequential:
    """Conv(c,32,3)-ReLU-Pool-Conv(32,64,3)-ReLU-Pool: the paper's MNIST stack (also used for 8x8 digits)."""
    return nn.Sequential(
        nn.Conv2d(channels, 32, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )


def _conv_bn(in_channels: int, out_channels: int) -> list[nn.Module]:
    return [nn.Conv2d(in_channels, out_channels, 3, padding=1), nn.BatchNorm2d(out_channels), nn.ReLU()]


def cifar_features(channels: int) -> nn.Sequential:
    """The paper's CIFAR stack: 2x Conv32 + Pool + 2x Conv64 + Pool, with batch norm (4096 features at 32x32)."""
    return nn.Sequential(
        *_conv_bn(channels, 32), *_conv_bn(32, 32), nn.MaxPool2d(2),
        *_conv_bn(32, 64), *_conv_bn(64, 64), nn.MaxPool2d(2),
        nn.Flatten(),
    )  # fmt: skip


class ConditionalCNN(nn.Module):
    """A conv feature stack, then [flat features || fingerprint] -> FC hidden -> ReLU -> FC classes.

    On 28x28 inputs this is the paper's MNIST network (3136 conv features, FC 128): 425,738
    parameters with a 32-d fingerprint and 10 classes; on 8x8 digits the small variant (256
    features); on 32x32 RGB the paper's CIFAR network (4096 features, FC 256).
    """

    def __init__(self, image_shape: tuple[int, int, int], num_classes: int, condition_dim: int = 0) -> None:
        super().__init__()
        channels, height, width = image_shape
        if height % 4 or width % 4:
            raise FedcondError(f"images must have sides divisible by 4 for two poolings, got {height}x{width}")
        cifar_like = channels == 3
        self.condition_dim = condition_dim
        self.features = cifar_features(channels) if cifar_like else small_features(channels)
        hidden = 256 if cifar_like else 128
        flat = 64 * (height // 4) * (width // 4)
        self.classifier = nn.Sequential(
            nn.Linear(flat + condition_dim, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, images: torch.Tensor, condition: torch.Tensor | None = None) -> torch.Tensor:
        features = self.features(images)
        if self.condition_dim:
            if condition is None:
                raise ValueError("a conditioned model needs its client's fingerprint")
            features = torch.cat([features, condition.expand(len(features), -1)], dim=1)
        return self.classifier(features)


def build_model(image_shape: tuple[int, int, int], num_classes: int, condition_dim: int, seed: int) -> ConditionalCNN:
    """A freshly initialised backbone; the same seed gives the same weights on every machine."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = ConditionalCNN(image_shape, num_classes, condition_dim)
    torch.random.set_rng_state(generator_state)
    return model


def build_run_model(config: RunConfig, num_classes: int, conditioned: bool, seed: int | None = None) -> ConditionalCNN:
    """The backbone of a run, as the server and every client build it (``seed`` defaults to the run's)."""
    from fedcond.datasets import dataset_spec

    condition_dim = config.fingerprint_dim if conditioned else 0
    image_shape = dataset_spec(config.dataset).image_shape
    return build_model(image_shape, num_classes, condition_dim, config.seed if seed is None else seed)


def count_parameters(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def get_weights(model: nn.Module) -> list[np.ndarray]:
    """The model's state as NumPy arrays, in ``state_dict`` order (what travels over Flower)."""
    return [tensor.detach().cpu().numpy().copy() for tensor in model.state_dict().values()]


def set_weights(model: nn.Module, weights: list[np.ndarray]) -> None:
    """Load arrays produced by ``get_weights`` of an identically built model."""
    state = model.state_dict()
    if len(weights) != len(state):
        raise FedcondError(
            f"received {len(weights)} arrays for a model with {len(state)}; server and client disagree "
            "on the model (same method, dataset and fingerprint-dim everywhere?)"
        )
    loaded = {}
    for (name, current), array in zip(state.items(), weights, strict=True):
        if tuple(current.shape) != tuple(array.shape):
            raise FedcondError(f"array for {name} has shape {array.shape}, the model expects {tuple(current.shape)}")
        loaded[name] = torch.from_numpy(np.asarray(array)).to(current.dtype)
    model.load_state_dict(loaded)
